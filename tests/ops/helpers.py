"""Shared helpers for the ops tests: seeded random inputs and error norms against the reference."""

from __future__ import annotations

import json
import math
import os
import zlib

import torch

from lit_thresh.ops import threshold_attention
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


def assert_rows_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Row by row (the last dim), got within tol of want in relative error norm plus the rounding floor of
    want in got's dtype; rows whose reference is all zero must be exactly zero."""
    w64 = want.double()
    norm = w64.norm(dim=-1)  # (B, H, T)
    assert torch.equal(got[norm == 0], torch.zeros_like(got[norm == 0])), name  # e.g. a first query below tau
    err = (got.double() - w64).norm(dim=-1)[norm > 0] / norm[norm > 0]  # one error per row
    floor = (want.to(got.dtype).double() - w64).norm(dim=-1)[norm > 0] / norm[norm > 0]
    assert (err < tol + floor).all(), f"{name}: worst row {(err - floor).max().item():.2e}"


def reference_with_grads(q, k, v, beta, power, scale, dout):
    """Reference output and (dq, dk, dv, dbeta) in float64 from the same input values."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    beta64 = beta.detach().double().requires_grad_() if isinstance(beta, torch.Tensor) else beta
    out = threshold_attention_reference(q64, k64, v64, beta64, power, scale)
    wrt = [q64, k64, v64] + ([beta64] if isinstance(beta, torch.Tensor) else [])
    grads = torch.autograd.grad(out, wrt, dout.double())
    return out, grads


def laid_out(gen, layout: str, b: int, h: int, t: int, dim: int, dtype, device) -> torch.Tensor:
    """A (B, H, T, D) input requiring grad: contiguous ('bhtd'), a (B, T, H, D) tensor seen as (B, H, T, D)
    ('bthd') or every other position and a slice of a wider head dim ('sliced')."""
    if layout == "bthd":
        return randn(gen, b, t, h, dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
    if layout == "sliced":
        return randn(gen, b, h, 2 * t, dim + 3, dtype=dtype, device=device)[:, :, ::2, 1 : dim + 1].requires_grad_()
    return randn(gen, b, h, t, dim, dtype=dtype, device=device).requires_grad_()


def check_against_reference(device, dtype, backend, b, hq, hkv, tq, tk, d, dv, beta, power, scale=1.0, layout="bhtd") -> bool:
    """Run forward + backward and compare output and every gradient with the reference (True when compared)."""
    gen = generator(device, dtype, backend, b, hq, hkv, tq, tk, d, dv, beta, power, scale, layout)

    q, k, v = (laid_out(gen, layout, b, h, t, dim, dtype, device) for h, t, dim in ((hq, tq, d), (hkv, tk, d), (hkv, tk, dv)))
    beta_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # a parameter's dtype
    if beta == "per_head":
        beta = randn(gen, hq, device=device, dtype=beta_dtype).requires_grad_()
    elif beta == "scalar_tensor":
        beta = randn(gen, device=device, dtype=beta_dtype).requires_grad_()
    out = threshold_attention(q, k, v, beta, power, scale=scale, backend=backend)
    assert out.shape == (b, hq, tq, dv) and out.dtype == dtype
    dout = randn(gen, b, hq, tq, dv, dtype=dtype, device=device)
    wrt = [q, k, v] + ([beta] if isinstance(beta, torch.Tensor) else [])
    grads = torch.autograd.grad(out, wrt, dout)
    ref, ref_grads = reference_with_grads(q, k, v, beta, power, scale, dout)

    assert all(g.dtype == t.dtype and g.shape == t.shape for g, t in zip(grads, wrt))
    # No kernel beats the exact result rounded to the output dtype (fp16 subnormals, say): that
    # rounding error is added to each bound. If the exact result overflows the dtype, there is
    # nothing to compare: return False (property tests discard such draws).
    floors = [rel_err(r.to(t.dtype), r) for r, t in zip((ref, *ref_grads), (out, *wrt))]
    if not all(math.isfinite(f) for f in floors):
        return False
    out_err = rel_err(out, ref)
    grad_errs = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv", "dbeta"), grads, ref_grads)}
    if os.environ.get("LIT_THRESH_ERROR_LOG"):  # one JSON line per case, to report the errors seen
        case = {"device": str(device), "dtype": str(dtype), "backend": backend, "shape": [b, hq, hkv, tq, tk, d, dv],
                "beta": str(beta) if not isinstance(beta, torch.Tensor) else "tensor", "power": power,
                "layout": layout, "out": out_err, **grad_errs}
        with open(os.environ["LIT_THRESH_ERROR_LOG"], "a") as f:
            f.write(json.dumps(case) + "\n")
    assert out_err < TOLERANCE[dtype] + floors[0], f"out: {out_err:.2e}"
    grad_tol = (SUBLINEAR_GRAD_TOLERANCE if power < 1 else TOLERANCE)[dtype]
    assert all(e < grad_tol + f for e, f in zip(grad_errs.values(), floors[1:])), f"tolerance {grad_tol}: {grad_errs}"
    return True


def record_tma(monkeypatch, module) -> list[bool]:
    """Patches module._sources (triton_launch's or triton_differential's) to note, per kernel launch, whether its
    inputs went to the kernel as TMA descriptors; returns the list it appends to."""
    sources, used = module._sources, []

    def spy(*args, **kwargs):
        srcs, use_tma = sources(*args, **kwargs)
        used.append(use_tma)
        return srcs, use_tma

    monkeypatch.setattr(module, "_sources", spy)
    return used


def differential_reference(q1, q2, k1, k2, v, beta, lam, power, scale):
    """A1 V - lam A2 V with an unclamped lambda (a float, 0-d or (Hq,)), materialising both maps
    (threshold_attention_reference); gradients reach every input that requires one."""
    lam = torch.as_tensor(lam, dtype=q1.dtype, device=q1.device).reshape(-1, 1, 1)  # (1|Hq, 1, 1)
    a1v = threshold_attention_reference(q1, k1, v, beta, power, scale)  # (B, Hq, Tq, Dv)
    return a1v - lam * threshold_attention_reference(q2, k2, v, beta, power, scale)

