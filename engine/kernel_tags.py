"""What may follow a model's layout in a CPU engine's fingerprint, and the test for it: the
ISA class the C kernels are built for, then the linears that run on oneDNN and the CPU they
were chosen on (engine/kernel_choice.py makes them), then the attention and layer ops that
run on torch's paths there (engine/op_choice.py). Apart from kernel_choice so that a router,
which only reads fingerprints, imports no torch."""
from __future__ import annotations

import re

ISA_PREFIX = "|isa:"
TAG_PREFIX = "|onednn:"
TORCH_PREFIX = "|torch:"
_OPS = r"[a-z_]+(,[a-z_]+)*(@[0-9a-f]{8})?"
KERNEL_TAG = re.compile(rf"({re.escape(ISA_PREFIX)}[a-z0-9_]+)?({re.escape(TAG_PREFIX)}{_OPS})?"
                        rf"({re.escape(TORCH_PREFIX)}{_OPS})?")


def is_kernel_tag(suffix: str) -> bool:
    """Whether `suffix` (what follows a model's layout in a fingerprint) is a CPU engine's
    kernel tags (`kernel_choice.isa_tag`, then `kernel_choice.tag` for the linears and for the
    other ops), and nothing else."""
    return KERNEL_TAG.fullmatch(suffix) is not None


def layout_part(fingerprint: str) -> str:
    """The model's layout in a fingerprint: what precedes the CPU kernels' tags."""
    return fingerprint.split(ISA_PREFIX)[0].split(TAG_PREFIX)[0].split(TORCH_PREFIX)[0]
