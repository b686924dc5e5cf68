"""The autograd.Function of threshold attention and the choice of backend under it."""

from __future__ import annotations

import os
from typing import Literal

import torch

from lit_thresh.ops.chunked import chunked_backward, chunked_forward

Backend = Literal["auto", "triton", "torch"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: Backend, q: torch.Tensor) -> Literal["triton", "torch"]:
    """'auto': Triton for CUDA (or, under TRITON_INTERPRET=1, CPU) tensors of a Triton dtype; else torch."""
    triton_device = q.is_cuda or (q.device.type == "cpu" and triton_interpreting())
    if backend == "auto":
        return "triton" if triton_device and q.dtype in TRITON_DTYPES else "torch"
    if backend == "triton":
        if not triton_device:
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); got device {q.device}"
            )
        if q.dtype not in TRITON_DTYPES:
            raise TypeError(f"backend='triton' supports float16, bfloat16 and float32; got {q.dtype}")
    return backend


class ThresholdAttentionFunction(torch.autograd.Function):
    """Causal threshold attention; saves only q, k, v and beta and recomputes scores in backward."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,  # (B, Hq, Tq, D)
        k: torch.Tensor,  # (B, Hkv, Tk, D)
        v: torch.Tensor,  # (B, Hkv, Tk, Dv)
        beta: torch.Tensor,  # (Hq,) float32 (float64 for float64 inputs)
        power: float,
        scale: float,
        backend: Literal["triton", "torch"],
    ) -> torch.Tensor:
        if backend == "triton":
            from lit_thresh.ops.triton_launch import triton_forward

            out = triton_forward(q, k, v, beta, power, scale)
        else:
            out = chunked_forward(q, k, v, beta, power, scale)
        ctx.save_for_backward(q, k, v, beta)
        ctx.power, ctx.scale, ctx.backend = power, scale, backend
        return out  # (B, Hq, Tq, Dv)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, beta = ctx.saved_tensors
        need_dbeta = ctx.needs_input_grad[3]
        if ctx.backend == "triton":
            from lit_thresh.ops.triton_launch import triton_backward

            grads = triton_backward(q, k, v, beta, ctx.power, ctx.scale, dout, need_dbeta)
        else:
            grads = chunked_backward(q, k, v, beta, ctx.power, ctx.scale, dout, need_dbeta)
        return *grads, None, None, None
