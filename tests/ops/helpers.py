"""Shared helpers for the ops tests: seeded random inputs and error norms against the reference."""

from __future__ import annotations

import zlib

import torch

from lit_thresh.ops.reference import threshold_attention_reference

# ||out - ref|| / ||ref|| bounds, forward and gradients, against a float64 reference computed from the
# same (rounded) inputs. fp32 differs from it by accumulation order only; bf16/fp16 also round P, dS
# and the outputs to 8 / 11 significant bits.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2, torch.float64: 1e-12}
# For p < 1 the gradient p x^(p-1) is unbounded as x -> 0+: score rounding near the threshold is
# amplified ~1e3x (float64 shows it too: 1e-13 instead of 1e-16), so gradients get looser bounds.
SUBLINEAR_GRAD_TOLERANCE = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 2.5e-2, torch.float64: 1e-10}


def generator(*key) -> torch.Generator:
    """A generator seeded from the test's parameters: fresh, different inputs per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_with_grads(q, k, v, beta, power, scale, dout):
    """Reference output and (dq, dk, dv, dbeta) in float64 from the same input values."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    beta64 = beta.detach().double().requires_grad_() if isinstance(beta, torch.Tensor) else beta
    out = threshold_attention_reference(q64, k64, v64, beta64, power, scale)
    wrt = [q64, k64, v64] + ([beta64] if isinstance(beta, torch.Tensor) else [])
    grads = torch.autograd.grad(out, wrt, dout.double())
    return out, grads
