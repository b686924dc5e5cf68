"""NaN inputs propagate as the math does (ReLU(NaN) = NaN) on every backend; empty inputs keep autograd.

A NaN score gives a NaN weight, so NaN reaches exactly the outputs and gradients that depend on it,
while future (masked) keys still contribute exactly 0. Only gradients that hold for either convention
of ReLU'(NaN) (1 as torch.relu's, or NaN) are checked at p = 1; at p = 2, p * NaN^(p-1) is NaN either way.
"""

from __future__ import annotations

import pytest
import torch

from lit_thresh.ops import threshold_attention, threshold_attention_reference
from tests.ops.helpers import generator, randn

BACKENDS = ["reference", "torch", "triton"]  # triton: TRITON_INTERPRET=1 on CPU (tests/conftest.py)
B, H, T, D = 2, 2, 40, 16  # T spans two 32-row tiles of the interpreter's kernels
ROW = 20  # the poisoned query row or key position: inside the first (diagonal, masked) tile


def _run(backend: str, q, k, v, beta, power):
    """Output and (dq, dk, dv, dbeta) for a fixed random dout."""
    q, k, v, beta = (t.detach().clone().requires_grad_() for t in (q, k, v, beta))
    if backend == "reference":
        out = threshold_attention_reference(q, k, v, beta, power)
    else:
        out = threshold_attention(q, k, v, beta, power, backend=backend)
    dout = randn(generator("dout"), *out.shape)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v, beta), dout))


def _inputs(backend, power):
    gen = generator("nan", backend, power)
    q, k, v = (randn(gen, B, H, T, D) for _ in range(3))
    return q, k, v, randn(gen, H, scale=0.3)


def _same_where(mask: torch.Tensor, got: torch.Tensor, clean: torch.Tensor) -> None:
    """got equals the NaN-free run where mask is True (so it is finite there)."""
    torch.testing.assert_close(got[mask], clean[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_poisons_its_row_only(backend, power):
    q, k, v, beta = _inputs(backend, power)
    clean = _run(backend, q, k, v, beta, power)
    q[0, 0, ROW, 3] = float("nan")
    out, dq, dk, dv, _ = _run(backend, q, k, v, beta, power)

    row = torch.zeros(B, H, T, dtype=torch.bool)
    row[0, 0, ROW] = True
    assert out[row].isnan().all()
    _same_where(~row, out, clean[0])
    _same_where(~row, dq, clean[1])  # each query's gradient depends on its own row only
    seen = torch.zeros(B, H, T, dtype=torch.bool)
    seen[0, 0, : ROW + 1] = True  # the keys row ROW attends to
    assert dk[seen].isnan().any(-1).all() and dv[seen].isnan().all()  # dk_j sums ds_ij * q_i
    other_heads = torch.ones(B, H, T, dtype=torch.bool)
    other_heads[0, 0] = False
    _same_where(other_heads, dk, clean[2])
    _same_where(other_heads, dv, clean[3])


@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_key_poisons_later_queries_only(backend, power):
    q, k, v, beta = _inputs(backend, power)
    clean = _run(backend, q, k, v, beta, power)
    k[1, 1, ROW, 0] = float("nan")
    out, dq, dk, dv, _ = _run(backend, q, k, v, beta, power)

    later = torch.zeros(B, H, T, dtype=torch.bool)
    later[1, 1, ROW:] = True  # queries that see key ROW
    assert out[later].isnan().all() and dq[later].isnan().any(-1).all()  # dq_i sums ds_ij * k_j
    _same_where(~later, out, clean[0])  # earlier queries: the future NaN key contributes exactly 0
    key = torch.zeros(B, H, T, dtype=torch.bool)
    key[1, 1, ROW] = True
    assert dv[key].isnan().all()
    if power == 2.0:  # dk_j sums ds_ij * q_i: NaN when ReLU'(NaN) is
        assert dk[key].isnan().all()
    _same_where(~key, dk, clean[2])
    _same_where(~key, dv, clean[3])


@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_beta_poisons_its_head_only(backend, power):
    q, k, v, beta = _inputs(backend, power)
    clean = _run(backend, q, k, v, beta, power)
    beta[1] = float("nan")
    out, dq, dk, dv, dbeta = _run(backend, q, k, v, beta, power)

    assert out[:, 1].isnan().all() and dv[:, 1].isnan().all()
    for got, ref in zip((out, dq, dk, dv), clean):
        torch.testing.assert_close(got[:, 0], ref[:, 0])  # the other head is untouched
    torch.testing.assert_close(dbeta[0], clean[4][0])
    if power == 2.0:
        assert dbeta[1].isnan()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("empty", ["batch", "queries"])
def test_empty_inputs_keep_autograd(backend, empty):
    gen = generator("empty", backend, empty)
    b, tq = (0, 6) if empty == "batch" else (2, 0)
    q = randn(gen, b, 4, tq, 16).requires_grad_()
    k, v = (randn(gen, b, 2, 6, 16).requires_grad_() for _ in range(2))
    beta = torch.full((4,), 0.5, requires_grad=True)
    out = threshold_attention(q, k, v, beta, 2.0, backend=backend)
    assert out.shape == (b, 4, tq, 16) and out.requires_grad
    out.sum().backward()
    for t in (q, k, v, beta):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
