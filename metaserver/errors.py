"""The metaserver's exception types and their one mapping to and from gRPC status codes.

The domain layer (`metaserver.service`) raises these; the servicer turns them into a gRPC
status with the message, and the client turns a status back into the same type.
"""
from __future__ import annotations

import grpc


class MetaError(Exception):
    """Base of every metaserver error; `code` is the gRPC status it travels as."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(MetaError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MetaError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(MetaError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(MetaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(MetaError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MetaError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(MetaError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MetaError):
    code = grpc.StatusCode.PERMISSION_DENIED


ERROR_BY_CODE: dict[grpc.StatusCode, type[MetaError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
                DeadlineExceeded, Unauthenticated, PermissionDenied)
}


def from_rpc_error(err: grpc.RpcError) -> MetaError:
    """The typed exception for a failed call (unknown codes become a plain MetaError)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = ERROR_BY_CODE.get(code, MetaError)
    exc = cls(details or code.name)
    exc.code = code
    return exc
