"""fp16 keeps P and dS in range with one power of two per row, fixed before the key loop (ROW_SCALE).

Each case drives P = ReLU(x)^p or dS = dP p ReLU(x)^(p-1) past fp16's largest value (65504), measured
in float64, while the outputs and gradients stay finite, and compares forward and every gradient with
the float64 reference. Rows of very different norms each get their own scale (checked row by row), and
inf or NaN inputs reach only what depends on them.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from lit_thresh.ops import threshold_attention
from lit_thresh.ops.reference import threshold_attention_reference, threshold_attention_weights
from tests.ops.helpers import (
    TOLERANCE, assert_rows_close, generator, randn, reference_with_grads, rel_err,
)
from tests.ops.sm90 import run_without_interpreter

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
FP16_MAX = 65504.0
TOL = TOLERANCE[torch.float16]


def _largest_p_and_ds(q, k, v, dout, beta: float, power: float, scale: float) -> tuple[float, float]:
    """max P and max |dS| of the causal map, in float64 (as the kernels form them before the fp16 cast)."""
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    w = threshold_attention_weights(q64, k64, beta, power, scale)  # (B, H, Tq, Tk)
    ds = (do64 @ v64.transpose(-1, -2)) * power * w ** ((power - 1.0) / power)  # dP p x^(p-1), x = w^(1/p)
    return w.max().item(), ds.abs().max().item()


def _compare(device, power, q, k, v, dout, beta: float, scale: float):
    """Forward and gradients (q, k, v, beta) against the reference: errors and the rounding floors."""
    beta_t = torch.full((q.shape[1],), beta, device=device, requires_grad=True)
    out = threshold_attention(q, k, v, beta_t, power, scale=scale, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v, beta_t), dout)
    ref, ref_grads = reference_with_grads(q, k, v, beta_t, power, scale, dout)
    got, want = (out, *grads), (ref, *ref_grads)
    assert all(w.abs().max() < FP16_MAX for w in want[:4]), "the exact results must be finite in fp16"
    return got, want


def _assert_finite_and_close(got, want) -> None:
    """Forward and gradients finite, each within fp16's tolerance plus its own rounding floor."""
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbeta"), got, want):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) < TOL + rel_err(w.to(g.dtype), w), name


# (power, scale of q and k, of v, of dO, softmax scale, beta): P past fp16 (scores up to ~1e3 for p = 2,
# P up to 5e5), then dS past fp16 (large dO and v, small scale so that dq, dk stay finite).
WEIGHT_RANGE = [(2.0, 6.0, 1e-3, 1e-3, 1.0, 0.5), (1.0, 30.0, 1e-2, 1e-2, 16.0, 0.5), (3.0, 3.0, 1e-4, 1e-4, 1.0, 0.5),
                (1.5, 20.0, 1e-3, 1e-3, 1.0, -0.5)]
GRAD_RANGE = [(1.0, 1e-2, 300.0, 300.0, 0.01, 0.0), (2.0, 14.0, 100.0, 100.0, 5e-4, 0.0), (1.5, 14.0, 100.0, 100.0, 4e-4, 0.0)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", WEIGHT_RANGE + GRAD_RANGE, ids=lambda c: f"p{c[0]}-qk{c[1]:g}-v{c[2]:g}-do{c[3]:g}")
def test_fp16_out_of_range_products_match_the_reference(device, case):
    power, qk, vs, dos, scale, beta = case
    gen = generator("fp16-range", case)
    q = randn(gen, 1, 2, 64, 32, scale=qk, dtype=torch.float16, device=device).requires_grad_()
    k = randn(gen, 1, 1, 64, 32, scale=qk, dtype=torch.float16, device=device).requires_grad_()  # GQA
    v = randn(gen, 1, 1, 64, 32, scale=vs, dtype=torch.float16, device=device).requires_grad_()
    dout = randn(gen, 1, 2, 64, 32, scale=dos, dtype=torch.float16, device=device)
    p_max, ds_max = _largest_p_and_ds(q, k, v, dout, beta, power, scale)
    assert max(p_max, ds_max) > FP16_MAX, "the case must drive P or dS out of fp16's range"
    got, want = _compare(device, power, q, k, v, dout, beta, scale)
    _assert_finite_and_close(got, want)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fp16_negative_scale_keeps_p_in_range(device):
    """scale < 0 flips the scores' sign, not their size: the row bounds take |scale|."""
    gen = generator("fp16-negative-scale")
    q = randn(gen, 1, 2, 64, 32, scale=6.0, dtype=torch.float16, device=device).requires_grad_()
    k = randn(gen, 1, 2, 64, 32, scale=6.0, dtype=torch.float16, device=device).requires_grad_()
    v = randn(gen, 1, 2, 64, 32, scale=1e-3, dtype=torch.float16, device=device).requires_grad_()
    dout = randn(gen, 1, 2, 64, 32, scale=1e-3, dtype=torch.float16, device=device)
    assert _largest_p_and_ds(q, k, v, dout, 0.5, 2.0, -1.0)[0] > FP16_MAX
    got, want = _compare(device, 2.0, q, k, v, dout, 0.5, -1.0)
    _assert_finite_and_close(got, want)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_fp16_negative_beta_short_sequence_keeps_the_padding_rows_in_range(device, t):
    """With beta < 0, -tau grows with the position, and a query tile's padding rows past Tq sit at later
    positions than any real row: the dK/dV kernel's key bound covers them, so dV stays finite."""
    gen = generator("fp16-short-negative-beta", t)
    q, k, v = (randn(gen, 1, 2, t, 16, scale=0.05, dtype=torch.float16, device=device).requires_grad_() for _ in range(3))
    dout = randn(gen, 1, 2, t, 16, dtype=torch.float16, device=device)
    got, want = _compare(device, 2.0, q, k, v, dout, -1.0, 1.0)
    _assert_finite_and_close(got, want)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power", [1.0, 1.5, 2.0])
def test_fp16_rows_of_very_different_norms_each_keep_their_precision(device, power):
    """Query norms over 4 decades, key norms over 1 (the largest key bounds every row): each row and each
    key's gradient is as accurate as fp16 allows, also where P is far below fp16's normal range (1e-5),
    which rounding P unscaled would lose."""
    gen = generator("fp16-rows", power)
    b, h, t, d = 1, 2, 96, 32
    q_norms = 10 ** torch.empty(b, h, t, 1).uniform_(-3.5, 0.5, generator=gen).double()
    k_norms = 10 ** torch.empty(b, h, t, 1).uniform_(-0.5, 0.5, generator=gen).double()
    q = (randn(gen, b, h, t, d, dtype=torch.float64) * q_norms).to(device, torch.float16).requires_grad_()
    k = (randn(gen, b, h, t, d, dtype=torch.float64) * k_norms).to(device, torch.float16).requires_grad_()
    v = randn(gen, b, h, t, d, dtype=torch.float16, device=device).requires_grad_()
    dout = randn(gen, b, h, t, d, dtype=torch.float16, device=device)
    p_min = threshold_attention_weights(q.detach().double(), k.detach().double(), 0.0, power)
    assert p_min[p_min > 0].min() < 1e-5, "some weights must be below fp16's normal range"
    got, want = _compare(device, power, q, k, v, dout, 0.0, 1.0)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_rows_close(name, g, w, TOL)


def _special_inputs(device):
    gen = generator("fp16-special")
    q, k = (randn(gen, 1, 2, 80, 32, scale=6.0, dtype=torch.float16, device=device) for _ in range(2))
    v = randn(gen, 1, 2, 80, 32, scale=1e-3, dtype=torch.float16, device=device)
    return q, k, v  # P up to ~1e5: the clean rows need their scale


def _out_and_grads(q, k, v, power):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = threshold_attention(q, k, v, 0.5, power, backend="triton")
    dout = randn(generator("fp16-special-dout"), *out.shape, scale=1e-3, dtype=torch.float16, device=q.device)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _same(got: torch.Tensor, clean: torch.Tensor) -> None:
    """Finite and equal to the clean run up to fp16 rounding (a bound may differ by the left-out norm, so
    may the power of two, and with it the rounding of P below fp16's normal range)."""
    assert torch.isfinite(got).all() and rel_err(got, clean) < 1e-3


def _tiles(device) -> tuple[int, int]:
    """Query rows per dQ program and keys per dK/dV program of the default tiles (D = 32)."""
    from lit_thresh.ops.triton_launch import default_configs

    cfgs = default_configs(32, torch.float16)
    return cfgs.bwd_dq.block_m, cfgs.bwd_dkv.block_n


# Not checked: inside the tile of a bad entry, a masked (exactly 0) dS still meets it in the dS K or dS^T Q
# product (0 * inf = NaN), for every dtype: the dq of earlier queries sharing the bad key's tile, and the
# dk of later keys sharing the bad query's tile.


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_fp16_inf_or_nan_key_leaves_the_bound_of_other_rows_alone(device, power, value):
    """An inf or NaN key has an inf or NaN norm, left out of the bounds: queries before it keep their
    clean results, so do the gradients of the other keys, and the queries that see it are finite exactly
    where the float64 math is (an inf key gives weight 0 where its score is -inf)."""
    q, k, v = _special_inputs(device)
    clean = _out_and_grads(q, k, v, power)
    key = 70
    k[0, 1, key, 3] = value
    out, dq, dk, dv = _out_and_grads(q, k, v, power)
    ref = threshold_attention_reference(*(t.double() for t in (q, k, v)), 0.5, power)
    finite = torch.isfinite(ref).all(-1)  # (B, H, T)
    assert torch.equal(torch.isfinite(out).all(-1), finite) and not finite[0, 1, key:].all()
    assert rel_err(out[finite], ref[finite]) < TOL + rel_err(ref[finite].half(), ref[finite])
    _same(out[0, 1, :key], clean[0][0, 1, :key])
    rows = key // _tiles(device)[0] * _tiles(device)[0]
    _same(dq[0, 1, :rows], clean[1][0, 1, :rows])
    others = torch.arange(k.shape[2], device=device) != key
    _same(dk[0, 1, others], clean[2][0, 1, others])
    _same(dv[0, 1, others], clean[3][0, 1, others])
    for got, want in zip((out, dq, dk, dv), clean):  # the other head: untouched
        torch.testing.assert_close(got[0, 0], want[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_fp16_inf_or_nan_query_poisons_its_row_only(device, value):
    """An inf or NaN query row: its own output and dq are not finite, every other row is as before, and
    so are the gradients of the keys it does not see."""
    q, k, v = _special_inputs(device)
    clean = _out_and_grads(q, k, v, 2.0)
    row = 30
    q[0, 0, row, 5] = value
    out, dq, dk, dv = _out_and_grads(q, k, v, 2.0)
    others = torch.ones(q.shape[:3], dtype=torch.bool, device=device)
    others[0, 0, row] = False
    assert not torch.isfinite(out[0, 0, row]).all() and not torch.isfinite(dq[0, 0, row]).all()
    _same(out[others], clean[0][others])
    _same(dq[others], clean[1][others])
    keys = (row // _tiles(device)[1] + 1) * _tiles(device)[1]  # the first key tile after the row's
    _same(dk[0, 0, keys:], clean[2][0, 0, keys:])
    _same(dv[0, 0, row + 1 :], clean[3][0, 0, row + 1 :])  # keys after the row: not seen by it
    for got, want in zip((dk, dv), clean[2:]):  # the other head: untouched
        torch.testing.assert_close(got[0, 1], want[0, 1], rtol=0, atol=0)


def test_fp16_kernels_compile_for_hopper(tmp_path):
    """The row-scaled kernels (ROW_SCALE, each power mode) and the per-tile backward of p < 1 (FP16_RANGE)
    compile for sm_90 with the fp16 default tiles at D = 128, in shared memory an H200 has (227 KiB).
    As torch.compile does, the float scalars are fp64; pointers and strides as a launch specialises them. ptxas
    assembles each kernel once (p = 1); its other power modes stop at PTX."""
    script = textwrap.dedent(
        """
        import torch
        from lit_thresh.ops import triton_kernels as tk
        from lit_thresh.ops.triton_launch import _single_metas, default_configs
        from tests.ops.sm90 import compile_for_sm90

        cfgs = default_configs(128, torch.float16)
        cases = [("threshold_fwd_kernel", "fwd", power) for power in (1.0, 2.0, 0.5)]
        cases += [(name, which, power) for name, which in (("threshold_bwd_dkv_kernel", "bwd_dkv"),
                  ("threshold_bwd_dq_kernel", "bwd_dq")) for power in (1.0, 2.0, 1.5, 0.5)]
        for name, which, power in cases:
            cfg = getattr(cfgs, which)
            fwd_meta, bwd_meta = _single_metas(128, 128, power, torch.float16, "ieee", False)
            consts = dict(fwd_meta if which == "fwd" else bwd_meta, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                          SKIP_ZERO=False, USE_TMA=False, BETA_GRAD=True)
            compiled = compile_for_sm90(getattr(tk, name), consts, "fp16", specialise=True, assemble=power == 1.0,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            assert bool(compiled.asm["cubin"]) == (power == 1.0), (name, power)
            assert compiled.metadata.shared <= 227 * 1024, (name, power, compiled.metadata.shared)
        print("compiled")
        """
    )
    run_without_interpreter(script, tmp_path, timeout=900)
