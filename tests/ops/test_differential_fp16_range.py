"""fp16 in the fused differential op: P = ReLU(x1)^p - lambda ReLU(x2)^p, dS1 and dS2 kept in fp16's range
by one power of two per row, fixed before the key loop (ROW_SCALE; lit_thresh/ops/triton_differential.py).

Each range case drives P, dS1 or dS2 past fp16's largest value (65504), measured in float64, while the
outputs and gradients stay finite, and compares the forward and all 7 gradients (q1, q2, k1, k2, v, beta,
lambda) with the float64 reference (lit_thresh/ops/reference.py). Rows of very different norms each get
their own scale (checked row by row), and inf or NaN inputs reach only what depends on them. lambda and
beta differ within GQA groups (the dK/dV kernel's group maxima), lambda = 0 takes the -inf bound path, and
one map's q or k far larger than the other's tells the maps' bounds apart.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_thresh.ops import differential_threshold_attention
from lit_thresh.ops.reference import threshold_attention_weights
from tests.ops.helpers import (
    SUBLINEAR_GRAD_TOLERANCE,
    TOLERANCE,
    assert_rows_close,
    differential_reference,
    generator,
    randn,
    rel_err,
)

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
FP16_MAX = 65504.0
TOL = TOLERANCE[torch.float16]
NAMES = ("out", "dq1", "dq2", "dk1", "dk2", "dv", "dbeta", "dlam")


def _largest(q1, q2, k1, k2, v, dout, beta, lam, power: float, scale: float) -> tuple[float, float, float]:
    """max |P|, max |dS1|, max |dS2| of the causal maps in float64 (as the kernels form them before the fp16 cast);
    beta and lam: one value or one per query head. dS is 0 where the weight is (masked or below tau)."""
    q1, q2, k1, k2, v, do = (t.detach().double() for t in (q1, q2, k1, k2, v, dout))
    group = q1.shape[1] // k1.shape[1]
    k1, k2, v = (t.repeat_interleave(group, 1) for t in (k1, k2, v))
    beta = torch.as_tensor(beta, dtype=torch.float64, device=q1.device)
    lam = torch.as_tensor(lam, dtype=torch.float64, device=q1.device).reshape(-1, 1, 1)
    w1, w2 = (threshold_attention_weights(q, k, beta, power, scale) for q, k in ((q1, k1), (q2, k2)))  # (B, H, Tq, Tk)
    dp = do @ v.transpose(-1, -2)
    # dP p x^(p-1), x = w^(1/p); 0 where w is (for p = 1, w^0 would be 1 there)
    ds1, ds2 = (dp * power * torch.where(w > 0, w ** ((power - 1.0) / power), 0.0) for w in (w1, w2))
    ds2 = lam * ds2
    return (w1 - lam * w2).abs().max().item(), ds1.abs().max().item(), ds2.abs().max().item()


def _run(inputs, dout, beta, lam, power: float, scale: float):
    """Forward and the 7 gradients of the Triton op, and the same from the float64 reference; beta and lam:
    one value or one per query head."""
    device, hq = inputs[0].device, inputs[0].shape[1]
    beta_t = torch.as_tensor(beta, dtype=torch.float32).expand(hq).to(device).clone().requires_grad_()
    lam_t = torch.as_tensor(lam, dtype=torch.float32).expand(hq).to(device).clone().requires_grad_()
    out = differential_threshold_attention(*inputs, beta_t, lam_t, power, scale=scale, backend="triton")
    got = (out, *torch.autograd.grad(out, (*inputs, beta_t, lam_t), dout))
    wrt = [t.detach().double().requires_grad_() for t in (*inputs, beta_t, lam_t)]
    ref = differential_reference(*wrt[:5], wrt[5], wrt[6], power, scale)
    return got, (ref, *torch.autograd.grad(ref, wrt, dout.double()))


def _assert_finite_and_close(got, want, grad_tol: float = TOL) -> None:
    """Forward and gradients finite, each within fp16's tolerance plus its own rounding floor."""
    assert all(w.abs().max() < FP16_MAX for w in want[:6]), "the exact results must be finite in fp16"
    for i, (name, g, w) in enumerate(zip(NAMES, got, want)):
        assert torch.isfinite(g).all(), name
        floor = rel_err(w.to(g.dtype), w)
        assert rel_err(g, w) < (TOL if i == 0 else grad_tol) + floor, f"{name}: {rel_err(g, w):.2e} (floor {floor:.1e})"


def _inputs(gen, device, hq, hkv, tq, tk, d, qk: float, vs: float, dos: float):
    q1, q2 = (randn(gen, 1, hq, tq, d, scale=qk, dtype=torch.float16, device=device).requires_grad_() for _ in range(2))
    k1, k2 = (randn(gen, 1, hkv, tk, d, scale=qk, dtype=torch.float16, device=device).requires_grad_() for _ in range(2))
    v = randn(gen, 1, hkv, tk, d, scale=vs, dtype=torch.float16, device=device).requires_grad_()
    dout = randn(gen, 1, hq, tq, d, scale=dos, dtype=torch.float16, device=device)
    return (q1, q2, k1, k2, v), dout


# (power, scale of q and k, of v, of dO, softmax scale, beta, lambda): P past fp16 (P1, P2 up to ~5e5),
# then dS1, dS2 past fp16 (large dO and v, small scale so that the gradients stay finite).
WEIGHT_RANGE = [(2.0, 6.0, 1e-3, 1e-3, 1.0, 0.5, 0.6), (1.0, 30.0, 1e-2, 1e-2, 16.0, 0.5, -0.7),
                (3.0, 3.0, 1e-4, 1e-4, 1.0, 0.5, 0.8), (1.5, 20.0, 1e-3, 1e-3, 1.0, -0.5, 0.3)]
GRAD_RANGE = [(1.0, 1e-2, 300.0, 300.0, 0.01, 0.0, 0.5), (2.0, 14.0, 100.0, 100.0, 5e-4, 0.0, -0.6),
              (1.5, 14.0, 100.0, 100.0, 4e-4, 0.0, 0.9)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", WEIGHT_RANGE + GRAD_RANGE, ids=lambda c: f"p{c[0]}-qk{c[1]:g}-v{c[2]:g}-lam{c[6]:g}")
def test_fp16_diff_out_of_range_products_match_the_reference(device, case):
    """GQA (two query heads per kv head) and Tq < Tk: the bounds run over the group and the right rows."""
    power, qk, vs, dos, scale, beta, lam = case
    inputs, dout = _inputs(generator("fp16-diff-range", case), device, 2, 1, 48, 64, 32, qk, vs, dos)
    assert max(_largest(*inputs, dout, beta, lam, power, scale)) > FP16_MAX, "P or dS must leave fp16's range"
    _assert_finite_and_close(*_run(inputs, dout, beta, lam, power, scale))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power,qk", [(1.0, 6.0), (2.0, 2.5), (1.5, 4.0)])
def test_fp16_diff_large_lambda_counts_in_the_bounds(device, power, qk):
    """|lambda| = 300: P1, P2 stay inside fp16 but P = P1 - lambda P2 does not; the P bound takes |lambda|
    (one head's lambda is negative), and so does the dS2 bound (dS2 = -lambda dP p x2^(p-1)). GQA with
    lambda differing within each group (0.5 and -300, then 300 and 0.6): the dK/dV kernel's bounds take
    the largest |lambda| of the group, which is not its first head's in group 0 nor its last head's in
    group 1."""
    inputs, dout = _inputs(generator("fp16-diff-lambda", power), device, 4, 2, 64, 64, 32, qk, 1e-3, 1e-3)
    lam = torch.tensor([0.5, -300.0, 300.0, 0.6])
    p_max = _largest(*inputs, dout, 0.5, lam, power, 1.0)[0]
    assert p_max > FP16_MAX and p_max / 300 < FP16_MAX
    _assert_finite_and_close(*_run(inputs, dout, 0.5, lam, power, 1.0))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power,qk", [(1.0, 60.0), (1.5, 9.0), (2.0, 6.0)])
def test_fp16_diff_zero_lambda_leaves_the_second_map_out_of_the_bounds(device, power, qk):
    """lambda = 0 makes log2 |lambda| = -inf: the P bound is then map 1's alone and the dS2 bound, -inf,
    gives dS2 (all exactly 0) no scale rather than 2^inf (0 * inf = NaN). Heads 0, 2, 3 have lambda = 0
    (the forward and dQ kernels' per-head path), GQA group 0 mixes 0 with 0.5 and group 1 is all 0 (the
    dK/dV kernel's group maximum, -inf); P leaves fp16's range, and dq2 of those heads and dk2 of group 1
    are exactly 0."""
    inputs, dout = _inputs(generator("fp16-diff-zero-lambda", power), device, 4, 2, 48, 64, 32, qk, 1e-3, 1e-3)
    lam = torch.tensor([0.0, 0.5, 0.0, 0.0])
    assert _largest(*inputs, dout, 0.5, lam, power, 1.0)[0] > FP16_MAX
    got, want = _run(inputs, dout, 0.5, lam, power, 1.0)
    _assert_finite_and_close(got, want)
    dq2, dk2 = got[2], got[4]
    assert torch.equal(dq2[:, [0, 2, 3]], torch.zeros_like(dq2[:, [0, 2, 3]])) and dq2[:, 1].abs().max() > 0
    assert torch.equal(dk2[:, 1], torch.zeros_like(dk2[:, 1])) and dk2[:, 0].abs().max() > 0


# (power, the input made larger, by how much, lambda, scale of q and k, of v and dO): one map's scores far
# larger than the other's. The P bound, max(base1^p, |lambda| base2^p) up to a bit, is symmetric in the maps
# but for lambda: with base1 and base2 swapped it is min(|lambda|, ratio^p) too small where map 2 is the
# larger, min(1 / |lambda|, ratio^p) where map 1 is: 64x (p = 1, 1.5), 256x (p = 2, whose forward rounds its
# exponent up to an even one) in the first six cases (forward, dK/dV). The dS bounds scale with
# base_m^(p-1): where one map's q or k is 64x larger (p = 2, the last four), its dS bounded by the other
# map's base would be 64x too small (dK/dV, dQ). q-scaled cases check the q norms the dK/dV kernel reads
# per map and the dQ kernel's own rows; k-scaled ones the forward's and the dQ kernel's k norms per map and
# the dK/dV kernel's own rows. v and dO are scaled so that every result stays within fp16's normal range.
MAP_IMBALANCE = [(1.0, "k2", 64, 64.0, 0.5, 0.05), (1.0, "q1", 64, -1 / 64, 0.5, 1.0),
                 (2.0, "q2", 16, 256.0, 0.125, 0.16), (2.0, "k1", 16, 1 / 256, 0.125, 2.0),
                 (1.5, "q2", 16, 64.0, 0.25, 0.2), (1.5, "k1", 16, 1 / 64, 0.5, 1.0),
                 (2.0, "q2", 64, 0.5, 0.5, 0.035), (2.0, "q1", 64, -0.5, 0.25, 0.25),
                 (2.0, "k2", 64, 0.5, 0.25, 0.3), (2.0, "k1", 64, 0.5, 0.25, 0.18)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", MAP_IMBALANCE, ids=lambda c: f"p{c[0]}-{c[1]}x{c[2]}-lam{c[3]:g}")
def test_fp16_diff_each_map_has_its_own_bound(device, case):
    """q1, q2, k1 or k2 16-64x (a power of two: exact) larger than its counterpart of the other map: each
    map's bounds come from its own q and k norms (base1 for map 1, base2 for map 2) in the forward, dK/dV
    and dQ kernels; one map's base used for the other's would leave P or dS far past its fp16 scale, so
    some output or gradient inf (the table above says which case catches what). GQA, Tq < Tk, beta = 0
    (tau = 0: the small scores of the smaller map stay live)."""
    power, big, ratio, lam, qk, vo = case
    inputs, dout = _inputs(generator("fp16-diff-imbalance", case), device, 2, 1, 48, 64, 32, qk, vo, vo)
    inputs = [t.detach() for t in inputs]
    which = ("q1", "q2", "k1", "k2").index(big)
    inputs[which] = inputs[which] * ratio
    inputs = tuple(t.requires_grad_() for t in inputs)
    w1, w2 = (threshold_attention_weights(q.detach().double(), k.detach().double(), 0.0, power)
              for q, k in ((inputs[0], inputs[2]), (inputs[1], inputs[3])))
    larger, smaller = (w2.max(), w1.max()) if big[1] == "2" else (w1.max(), w2.max())
    assert larger > ratio**power / 4 * smaller, "the maps' weights must differ by about ratio^p"
    _assert_finite_and_close(*_run(inputs, dout, 0.0, lam, power, 1.0))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fp16_diff_negative_scale_keeps_p_in_range(device):
    """scale < 0 flips the scores' sign, not their size: the row bounds take |scale|."""
    inputs, dout = _inputs(generator("fp16-diff-negative-scale"), device, 2, 2, 64, 64, 32, 6.0, 1e-3, 1e-3)
    assert _largest(*inputs, dout, 0.5, 0.5, 2.0, -1.0)[0] > FP16_MAX
    _assert_finite_and_close(*_run(inputs, dout, 0.5, 0.5, 2.0, -1.0))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_fp16_diff_negative_beta_short_sequence_keeps_the_padding_rows_in_range(device, t):
    """With beta < 0, -tau grows with the position, and a query tile's padding rows past Tq sit at later
    positions than any real row: the dK/dV kernel's P bound covers them, so dV stays finite. GQA with beta
    differing within each group (0.5 and -1, then -1 and 0.5): the bound takes the group's most negative
    beta, which is not its first head's in group 0 nor its last head's in group 1."""
    inputs, dout = _inputs(generator("fp16-diff-short-negative-beta", t), device, 4, 2, t, t, 16, 0.05, 0.05, 1.0)
    _assert_finite_and_close(*_run(inputs, dout, [0.5, -1.0, -1.0, 0.5], 0.5, 2.0, 1.0))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power", [1.0, 1.5, 2.0])
def test_fp16_diff_rows_of_very_different_norms_each_keep_their_precision(device, power):
    """Query norms over 4 decades (the same for a row of q1 and of q2), key norms over 1: each output row
    and each dq row is as accurate as fp16 allows, also where P is far below fp16's normal range (1e-5),
    which rounding P unscaled would lose. dk1, dk2, dv are checked as a whole: a key's P^T and dS^T rows
    are bounded with the largest |q| of the query rows from its key tile on, so a key seen only by tiny
    queries (here key 95 of head 1, P ~ 6e-5 against a bound ~ 1e5) can land in fp16's subnormals and
    lose digits (0.5% on that row), as in the single op."""
    gen = generator("fp16-diff-rows", power)
    b, h, t, d = 1, 2, 96, 32

    def spread(norms):
        return (randn(gen, b, h, t, d, dtype=torch.float64) * norms).to(device, torch.float16).requires_grad_()

    q_norms = 10 ** torch.empty(b, h, t, 1).uniform_(-3.5, 0.5, generator=gen).double()  # one per row of q1 and q2
    k_norms = 10 ** torch.empty(b, h, t, 1).uniform_(-0.5, 0.5, generator=gen).double()
    q1, q2, k1, k2 = spread(q_norms), spread(q_norms), spread(k_norms), spread(k_norms)
    v = randn(gen, b, h, t, d, dtype=torch.float16, device=device).requires_grad_()
    dout = randn(gen, b, h, t, d, dtype=torch.float16, device=device)
    p1_min = threshold_attention_weights(q1.detach().double(), k1.detach().double(), 0.0, power)
    assert p1_min[p1_min > 0].min() < 1e-5, "some weights must be below fp16's normal range"
    got, want = _run((q1, q2, k1, k2, v), dout, 0.0, 0.7, power, 1.0)
    for name, g, w in zip(NAMES[3:6], got[3:6], want[3:6]):
        assert rel_err(g, w) < TOL + rel_err(w.to(g.dtype), w), name
    for name, g, w in zip(NAMES[:3], got[:3], want[:3]):
        assert_rows_close(name, g, w, TOL)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power,qk", [(1.0, 12.0), (2.0, 1.0)])
def test_fp16_diff_gqa_bounds_take_every_head_of_the_group(device, power, qk):
    """GQA (4 query heads, 2 kv heads) with Tq < Tk: in each group the second query head has 8x the q
    norms of the first and the earliest query rows the largest of all, so a key's bounds must take the
    maxima over every head of the group and over the query rows from Tk - Tq on."""
    gen = generator("fp16-diff-gqa", power)
    hq, hkv, tq, tk, d = 4, 2, 40, 72, 32
    inputs, dout = _inputs(gen, device, hq, hkv, tq, tk, d, qk, 1e-3, 1e-3)
    q1, q2, k1, k2, v = (t.detach() for t in inputs)
    rows = torch.linspace(3.0, 1.0, tq, dtype=torch.float64, device=device).reshape(1, 1, tq, 1)  # earliest rows largest
    heads = torch.tensor([1.0, 8.0, 1.0, 8.0], dtype=torch.float64, device=device).reshape(1, hq, 1, 1)
    q1, q2 = ((q.double() * rows * heads).half().requires_grad_() for q in (q1, q2))
    k1, k2 = ((k * 2).requires_grad_() for k in (k1, k2))
    inputs = (q1, q2, k1, k2, v.requires_grad_())
    assert _largest(*inputs, dout, 0.5, 0.5, power, 1.0)[0] > FP16_MAX
    _assert_finite_and_close(*_run(inputs, dout, 0.5, 0.5, power, 1.0))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fp16_diff_sublinear_power_matches_the_reference(device):
    """Regression guard: p < 1 row-scales the forward's P and keeps the per-tile scaling of dS1, dS2 in
    the backward (dS has no bound as x -> 0+); GQA, Tq < Tk."""
    inputs, dout = _inputs(generator("fp16-diff-sublinear"), device, 2, 1, 30, 45, 32, 1.0, 1.0, 1.0)
    _assert_finite_and_close(*_run(inputs, dout, 0.2, 0.6, 0.5, 0.5), SUBLINEAR_GRAD_TOLERANCE[torch.float16])


def _special_inputs(device):
    gen = generator("fp16-diff-special")
    q1, q2, k1, k2 = (randn(gen, 1, 2, 80, 32, scale=6.0, dtype=torch.float16, device=device) for _ in range(4))
    v = randn(gen, 1, 2, 80, 32, scale=1e-3, dtype=torch.float16, device=device)
    return [q1, q2, k1, k2, v]  # P up to ~1e5: the clean rows need their scale


def _out_and_grads(inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    lam = torch.tensor([0.5, 0.7], device=inputs[0].device)
    out = differential_threshold_attention(*inputs, 0.5, lam, 2.0, backend="triton")
    dout = randn(generator("fp16-diff-special-dout"), *out.shape, scale=1e-3, dtype=torch.float16, device=out.device)
    return (out.detach(), *torch.autograd.grad(out, inputs, dout))


def _same(got: torch.Tensor, clean: torch.Tensor) -> None:
    """Finite and equal to the clean run up to fp16 rounding (a bound may differ by the left-out norm, so
    may the power of two, and with it the rounding of P below fp16's normal range)."""
    assert torch.isfinite(got).all() and rel_err(got, clean) < 1e-3


def _tiles() -> tuple[int, int]:
    """Query rows per dQ program and keys per dK/dV program of the default tiles (D = 32)."""
    from lit_thresh.ops.triton_differential import default_diff_configs

    cfgs = default_diff_configs(32, torch.float16)
    return cfgs.bwd_dq.block_m, cfgs.bwd_dkv.block_n


# Not checked, as for the single op: inside the tile of a bad entry, a masked (exactly 0) dS still meets it
# in the dS K or dS^T Q product (0 * inf = NaN): the dq of earlier queries sharing the bad key's tile, and
# the dk of later keys sharing the bad query's tile.


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("which,value", [(2, math.inf), (3, math.nan)], ids=["k1-inf", "k2-nan"])
def test_fp16_diff_inf_or_nan_key_leaves_the_bound_of_other_rows_alone(device, which, value):
    """An inf or NaN key (of either map) has an inf or NaN norm, left out of the bounds: queries before it
    keep their clean results, so do the gradients of the other keys, and the queries that see it are
    finite exactly where the float64 math is (an inf key gives weight 0 where its score is -inf)."""
    inputs = _special_inputs(device)
    clean = _out_and_grads(inputs)
    key = 70
    inputs[which][0, 1, key, 3] = value
    out, dq1, dq2, dk1, dk2, dv = _out_and_grads(inputs)
    lam = torch.tensor([0.5, 0.7], dtype=torch.float64, device=device)
    ref = differential_reference(*(t.double() for t in inputs), 0.5, lam, 2.0, 1.0)
    finite = torch.isfinite(ref).all(-1)  # (B, H, T)
    assert torch.equal(torch.isfinite(out).all(-1), finite) and not finite[0, 1, key:].all()
    assert rel_err(out[finite], ref[finite]) < TOL + rel_err(ref[finite].half(), ref[finite])
    _same(out[0, 1, :key], clean[0][0, 1, :key])
    rows = key // _tiles()[0] * _tiles()[0]
    for dq, dq_clean in zip((dq1, dq2), clean[1:3]):
        _same(dq[0, 1, :rows], dq_clean[0, 1, :rows])
    others = torch.arange(out.shape[2], device=device) != key
    for g, g_clean in zip((dk1, dk2, dv), clean[3:]):
        _same(g[0, 1, others], g_clean[0, 1, others])
    for got, want in zip((out, dq1, dq2, dk1, dk2, dv), clean):  # the other head: untouched
        torch.testing.assert_close(got[0, 0], want[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("which,value", [(0, math.nan), (1, math.inf)], ids=["q1-nan", "q2-inf"])
def test_fp16_diff_inf_or_nan_query_poisons_its_row_only(device, which, value):
    """An inf or NaN query row (of either map): its own output is not finite, every other row is as before,
    and so are the gradients of the keys it does not see."""
    inputs = _special_inputs(device)
    clean = _out_and_grads(inputs)
    row = 30
    inputs[which][0, 0, row, 5] = value
    out, dq1, dq2, dk1, dk2, dv = _out_and_grads(inputs)
    others = torch.ones(out.shape[:3], dtype=torch.bool, device=device)
    others[0, 0, row] = False
    assert not torch.isfinite(out[0, 0, row]).all() and not torch.isfinite((dq1, dq2)[which][0, 0, row]).all()
    _same(out[others], clean[0][others])
    for dq, dq_clean in zip((dq1, dq2), clean[1:3]):
        _same(dq[others], dq_clean[others])
    keys = (row // _tiles()[1] + 1) * _tiles()[1]  # the first key tile after the row's
    for g, g_clean in zip((dk1, dk2), clean[3:5]):
        _same(g[0, 0, keys:], g_clean[0, 0, keys:])
    _same(dv[0, 0, row + 1 :], clean[5][0, 0, row + 1 :])  # keys after the row: not seen by it
    for got, want in zip((dk1, dk2, dv), clean[3:]):  # the other head: untouched
        torch.testing.assert_close(got[0, 1], want[0, 1], rtol=0, atol=0)
