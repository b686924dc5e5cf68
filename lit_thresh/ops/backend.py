"""Which implementation runs an op: Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) or PyTorch."""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# the most (batch, head)s the Triton kernels take: their grids give them CUDA's second axis, of at most 65535
MAX_BATCH_HEADS = 65535


# the values Triton reads a boolean variable as true (case aside), as its knobs.runtime.interpret does
_TRUE_VALUES = ("1", "true", "on", "yes", "y")


def triton_interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1, or true, on,
    yes, y, in any case: what Triton itself accepts). Reads os.environ, which torch.compile can trace."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE_VALUES


def resolve_backend(backend: Backend, q: torch.Tensor) -> Literal["triton", "torch"]:
    """'auto': Triton for CUDA (or, under TRITON_INTERPRET=1, CPU) tensors of a Triton dtype with at most
    MAX_BATCH_HEADS (batch, head)s; else torch. q: (B, Hq, Tq, D), checked."""
    triton_device = q.is_cuda or (q.device.type == "cpu" and triton_interpreting())
    batch_heads = q.shape[0] * q.shape[1]
    if backend == "auto":
        fits = triton_device and q.dtype in TRITON_DTYPES and batch_heads <= MAX_BATCH_HEADS
        return "triton" if fits else "torch"
    if backend == "triton":
        if not triton_device:
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); got device {q.device}"
            )
        if q.dtype not in TRITON_DTYPES:
            raise TypeError(f"backend='triton' supports float16, bfloat16 and float32; got {q.dtype}")
        if batch_heads > MAX_BATCH_HEADS:
            raise ValueError(
                f"backend='triton' takes at most {MAX_BATCH_HEADS} (batch, head)s, the kernels' grid limit on CUDA; "
                f"got q with batch {q.shape[0]} x {q.shape[1]} heads = {batch_heads}: split the batch, or use "
                "backend='auto' or 'torch' (blockwise PyTorch)"
            )
    return backend
