"""Skipping all-zero tiles (BlockConfig.skip_zero) changes no result, forward or backward.

A skipped tile would have added exact zeros, so skip on and off must agree bit for bit, and both must
match the float64 reference. A tile holding a NaN score is not all-zero and must not be skipped. The
float32 cases load tiles through pointers, the float16 ones through TMA tensor descriptors (BlockConfig.tma).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_thresh.ops.reference import threshold_attention_weights
from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs, _tma_ready, triton_backward, triton_forward
from tests.ops.helpers import TOLERANCE, generator, randn, reference_with_grads, rel_err

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
BLOCK = 16


def _configs(skip_zero: bool, block: int, tma: bool) -> KernelConfigs:
    cfg = BlockConfig(block, block, skip_zero=skip_zero, tma=tma)
    return KernelConfigs(cfg, cfg, cfg)


def _sparse_inputs(gen, device, dtype, t: int, d: int):
    """Unit q, k with a high threshold (beta 1.2: few scores pass) and a few planted aligned pairs, so
    that most causal (query tile, key tile) pairs are all-zero and some are not."""
    q = F.normalize(randn(gen, 1, 2, t, d, dtype=torch.float64), dim=-1)  # (1, 2, T, D)
    k = F.normalize(randn(gen, 1, 2, t, d, dtype=torch.float64), dim=-1)
    for i, j in ((t - 1, 3), (t // 2, t // 2 - 20), (t // 2 + 5, t // 2 + 3)):
        k[:, :, j] = q[:, :, i]  # score 1 > tau (tau <= 1.2 * sqrt(2 ln(T) / D) < 1 here)
    v = randn(gen, 1, 2, t, d, dtype=torch.float64)
    beta = torch.tensor([1.2, 1.4], dtype=torch.float32)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)], beta.to(device)


def _zero_tile_fraction(q, k, beta, block: int) -> float:
    """Fraction of the causal (query tile, key tile) pairs whose weights are all 0."""
    w = threshold_attention_weights(q.double(), k.double(), beta.double(), 2.0)  # (B, H, T, T)
    t = w.shape[-1]
    n = -(-t // block)
    tiles = F.pad(w, (0, n * block - t, 0, n * block - t)).unflatten(-1, (n, block)).unflatten(-3, (n, block))
    live = tiles.ne(0).any(-1).any(-2)  # (B, H, n, n): query tile, key tile
    causal = torch.ones(n, n, dtype=torch.bool, device=w.device).tril()
    return 1.0 - live[..., causal].float().mean().item()


def _run_both(q, k, v, beta, dout, block, tma=False):
    """(out, dq, dk, dv, dbeta) with skip_zero off; on, the backward skipping by the forward's map (as in
    training); on, by a pre-pass's map (a backward called alone)."""
    results = []
    for skip, forward_map in ((False, False), (True, True), (True, False)):
        cfgs = _configs(skip, block, tma)
        out, live = triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)
        assert (live is not None) == skip
        live = live if forward_map else None
        results.append((out, *triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=live)))
    return results


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("sparse", [True, False], ids=["mostly_zero_tiles", "dense"])
def test_skip_on_and_off_agree_and_match_reference(device, dtype, sparse):
    gen = generator("skip", device, dtype, sparse)
    t, d = 80, 16
    if sparse:
        (q, k, v), beta = _sparse_inputs(gen, device, dtype, t, d)
        assert _zero_tile_fraction(q, k, beta, BLOCK) > 0.5, "the test must have mostly all-zero tiles"
    else:
        q, k, v = (randn(gen, 1, 2, t, d, dtype=dtype, device=device) for _ in range(3))
        beta = torch.tensor([-0.5, 0.3], device=device)
        assert _zero_tile_fraction(q, k, beta, BLOCK) == 0.0
    dout = randn(gen, 1, 2, t, d, dtype=dtype, device=device)
    tma = dtype == torch.float16
    assert _tma_ready(q, k, v, dout), "the TMA case must not fall back to pointer loads"
    off, *ons = _run_both(q, k, v, beta, dout, BLOCK, tma)
    for on in ons:
        for a, b in zip(off, on):
            assert torch.equal(a, b), "a skipped tile must only leave out exact zeros"
    ref, ref_grads = reference_with_grads(q, k, v, beta, 2.0, 1.0, dout)
    for got, want in zip(off, (ref, *ref_grads)):
        assert rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_nan_tile_is_not_skipped(device):
    """A NaN query row inside an otherwise all-zero region gives NaN there, skip on or off."""
    gen = generator("skip-nan", device)
    (q, k, v), beta = _sparse_inputs(gen, device, torch.float32, 80, 16)
    q[0, 0, 70] = float("nan")
    dout = randn(gen, 1, 2, 80, 16, device=device)
    for out, dq, dk, dv, dbeta in _run_both(q, k, v, beta, dout, BLOCK):
        assert out[0, 0, 70].isnan().all() and not out[0, 0, :70].isnan().any() and not out[0, 1].isnan().any()
        assert dq[0, 0, 70].isnan().all() and dbeta[0].isnan() and not dbeta[1].isnan()
        assert dk[0, 0, :71].isnan().all() and dv[0, 0, :71].isnan().all() and not dv[0, 0, 71:].isnan().any()
        assert not any(g[0, 1].isnan().any() for g in (out, dq, dk, dv))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_backward_skips_what_its_map_leaves_out(device):
    """The backward really runs over the map's lists: given a map of zeros it leaves out the tiles whose
    weights are not zero (its gradients change), given a map of ones it runs every tile (the same as skip
    off, bit for bit). A map of the wrong shape or dtype is refused by name."""
    gen = generator("skip-lists", device)
    (q, k, v), beta = _sparse_inputs(gen, device, torch.float32, 80, 16)
    dout = randn(gen, 1, 2, 80, 16, device=device)
    off = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, _configs(False, BLOCK, False))
    cfgs = _configs(True, BLOCK, False)
    live = triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)[1]
    none = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=torch.zeros_like(live))
    every = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=torch.ones_like(live))
    assert not torch.equal(none[0], off[0]) and not torch.equal(none[1], off[1])
    assert all(torch.equal(a, b) for a, b in zip(every, off))
    for bad in (live[:, :-1], live.int()):
        with pytest.raises(ValueError, match="live must be the forward's int8 map"):
            triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=bad)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_row_listing_seven_eighths_of_its_tiles_runs_them_all(device):
    """A backward row whose list holds >= 7/8 of its unmasked tiles runs the plain loop over every tile
    (_runs_plain): given a dense map with one live tile marked dead in a row of 9, both kernels still run it
    (bit for bit as skip off); with two marked dead in that row, the dQ kernel's row of 9 skips them (7 < 7/8 of
    9) while the dK/dV kernel's rows, each still at 8 of 9 or 7 of 8, do not."""
    gen = generator("skip-nearly-full", device)
    t, d = 10 * BLOCK, 16
    q, k, v, dout = (randn(gen, 1, 1, t, d, device=device) for _ in range(4))
    beta = torch.tensor([-0.5], device=device)  # about half the causal weights > 0: every tile holds some
    cfgs = _configs(True, BLOCK, False)
    off = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, _configs(False, BLOCK, False))
    live = triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)[1]  # (1, 10, 10)
    below = torch.ones(10, 10, dtype=torch.bool, device=device).tril(-1)
    assert live[0][below].all(), "a dense map marks every tile below the diagonal"
    one, two = live.clone(), live.clone()
    one[0, 9, 0] = 0  # query tile 9 lists 8 of its 9 key tiles; key tile 0 lists 8 of its 9 query tiles
    two[0, 9, :2] = 0  # query tile 9: 7 of 9; key tile 0: 8 of 9; key tile 1: 7 of 8
    got = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=one)
    assert all(torch.equal(a, b) for a, b in zip(got, off))
    dq, dk, dv, _ = triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=two)
    last = slice(9 * BLOCK, t)
    first = slice(0, 9 * BLOCK)
    assert torch.equal(dk, off[1]) and torch.equal(dv, off[2]) and torch.equal(dq[..., first, :], off[0][..., first, :])
    assert not torch.equal(dq[..., last, :], off[0][..., last, :]), "two dead tiles of nine: the row runs its list"


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_an_inf_in_q_keeps_every_tile(device):
    """A query tile whose rows are inf along one axis scores -inf (weight 0) on keys pointing away from
    it, but its gradient into those keys is 0 * inf = NaN: with an inf in q or k nothing is skipped, so
    skip on and off agree, NaN for NaN."""
    gen = generator("skip-inf", device)
    (q, k, v), beta = _sparse_inputs(gen, device, torch.float32, 80, 16)
    q[0, 0, 64:] = 0.0
    q[0, 0, 64:, 0] = float("inf")  # query tile 4 of head 0
    k[0, 0, :, 0] = -k[0, 0, :, 0].abs() - 0.1  # every key scores -inf with those rows
    dout = randn(gen, 1, 2, 80, 16, device=device)
    causal = torch.ones(5, 5, dtype=torch.bool, device=device).tril()
    for source in ("prepass", "forward"):
        assert _tile_map(source, q, k, beta, (16, 16)).bool().equal(causal.expand(2, 5, 5))
    off, *ons = _run_both(q, k, v, beta, dout, BLOCK)
    assert off[2][0, 0, :64, 0].isnan().all()  # dk: 0 * inf
    for on in ons:
        for a, b in zip(off, on):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _true_live_tiles(q, k, beta, block_m: int, block_n: int) -> torch.Tensor:
    """(B * H, n_m, n_n) bool: the (query tile, key tile) pairs holding a nonzero float64 weight."""
    w = threshold_attention_weights(q.double(), k.double(), beta.double(), 2.0)  # (B, H, Tq, Tk)
    tq, tk = w.shape[-2:]
    n_m, n_n = -(-tq // block_m), -(-tk // block_n)
    w = F.pad(w, (0, n_n * block_n - tk, 0, n_m * block_m - tq))
    tiles = w.unflatten(-1, (n_n, block_n)).unflatten(-3, (n_m, block_m))  # (B, H, n_m, bm, n_n, bn)
    return tiles.ne(0).any(-1).any(-2).flatten(0, 1)


def _tile_map(source: str, q, k, beta, grain: tuple[int, int], power: float = 2.0) -> torch.Tensor:
    """The skip_zero map at grain from the pre-pass (live_tiles) or written by the forward kernel."""
    from lit_thresh.ops.triton_launch import _problem_plan, live_tiles

    if source == "prepass":
        _, (_, kw), _ = _problem_plan(q, q, q, power, None)
        return live_tiles(q, k, beta, 1.0, grain, kw)
    cfg = BlockConfig(*grain, skip_zero=True)
    return triton_forward(q, k, k, beta, power, 1.0, KernelConfigs(cfg, cfg, cfg))[1]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("source", ["prepass", "forward"])
def test_the_tile_map_keeps_every_tile_with_a_weight_and_drops_most_others(device, block_m, block_n, source):
    """The skip_zero map, from the pre-pass or the forward kernel: 1 on every tile with a nonzero weight
    (it must never drop one), 0 on almost all the others (only scores within its rounding margin of tau
    count as live beyond them); a NaN score keeps its tile; Tq < Tk and GQA (4 query heads on 2 kv heads)."""
    gen = generator("tile-map", device, block_m, block_n)
    (q, k, _), beta = _sparse_inputs(gen, device, torch.float32, 80, 16)
    q = torch.cat([q, q.flip(-2)], dim=1)[:, :, 24:]  # (1, 4, 56, 16): Tq < Tk, GROUP 2
    beta = torch.cat([beta, beta.flip(0)])
    live = _tile_map(source, q, k, beta, (block_m, block_n)).bool().cpu()
    want = _true_live_tiles(q, k.repeat_interleave(2, dim=1), beta, block_m, block_n).cpu()
    assert live.shape == want.shape and want.any() and (~want).any()
    assert not (want & ~live).any(), "a tile with a weight was marked all-zero"
    assert (live & ~want).sum() <= 0.02 * (~want).sum()
    q[0, 1, 30] = float("nan")
    live = _tile_map(source, q, k, beta, (block_m, block_n)).bool().cpu()
    assert live[1, 30 // block_m, : (24 + 30) // block_n + 1].all()  # every causal key tile of the NaN row


@pytest.mark.parametrize("source,dtype,power", [("prepass", torch.float32, 2.0), ("forward", torch.float32, 2.0),
                                                ("forward", torch.float16, 2.0), ("forward", torch.float16, 1.0),
                                                ("forward", torch.float16, 0.5)], ids=str)
def test_the_tile_map_keeps_scores_within_its_margin_of_tau_and_a_nan_beta_head(source, dtype, power):
    """A tile whose scores sit just below tau (x = -margin / 2: weight 0 here, but another product's
    rounding could lift it above) stays live; one 5 margins below is dropped. A NaN beta keeps every causal
    tile of its head and no other head's. The forward in float16 scales its scores by rows for p = 1 and 2,
    and its cut with them; for other p it scales P instead."""
    t, d = 64, 16
    u = torch.zeros(d)
    u[0] = 1.0
    q = -u.repeat(1, 2, t, 1)  # (1, 2, T, D): every score -1, far below tau
    k = u.repeat(1, 2, t, 1)
    beta = torch.tensor([1.0, 1.0])
    tau = lambda i: math.sqrt(2 * math.log(i + 1) / d)  # beta 1
    margin = 1e-2  # 1e-2 |scale| max|q| max|k|, all norms 1
    q[0, :, 40, 0] = tau(40) - margin / 2  # row 40 (query tile 2): x = -margin / 2 on keys 0..40
    q[0, :, 50, 0] = tau(50) - 5 * margin  # row 50 (query tile 3): x = -5 margins
    q, k = q.to(dtype), k.to(dtype)
    live = _tile_map(source, q, k, beta, (16, 16), power)  # (2, 4, 4)
    assert live[:, 2, :3].all() and not live[:, 3].any() and not live[:, :2].any()
    beta[0] = float("nan")
    live = _tile_map(source, q, k, beta, (16, 16), power)
    assert live[0].bool().equal(torch.ones(4, 4, dtype=torch.bool).tril()) and not live[1, 3].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_skip_on_and_off_agree_with_the_default_tiles_on_a_gpu(dtype, d):
    """The production configs (TMA, 64-128 tiles, pipelined list loops, a map grain shared by dK/dV and
    dQ) with skip_zero on and off, bit for bit, on a map with most tiles all zero."""
    from lit_thresh.ops.triton_launch import default_configs, skip_zero_configs

    gen = generator("skip-gpu", dtype, d)
    t = 1024
    q, k = (F.normalize(randn(gen, 2, 4, t, d, device="cuda"), dim=-1) for _ in range(2))  # (2, 4, T, D)
    for i, j in ((t - 1, 5), (600, 300), (900, 899)):
        k[:, :, j] = q[:, :, i]
    q, k = q.to(dtype), k.to(dtype)
    v, dout = (randn(gen, 2, 4, t, d, device="cuda").to(dtype) for _ in range(2))
    beta = torch.full((4,), 3.0, device="cuda")
    results = []
    for cfgs in (default_configs(d, dtype), skip_zero_configs(d, dtype)):
        out, live = triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)
        results.append((out, *triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=live)))
    assert not live[:, 2:, 0].all(), "the forward's map must leave unmasked tiles to skip"
    assert results[0][0].abs().sum() > 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


TILES_A = ((16, 32), (16, 16), (32, 16))  # fwd, dK/dV, dQ: each its own
TILES_B = ((32, 16), (16, 32), (16, 32))  # dK/dV and dQ alike


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(  # each dtype, tile set and power at least once (the list loops do not depend on p)
    "dtype,tiles,power",
    [(torch.float32, TILES_A, 2.0), (torch.float16, TILES_B, 2.0), (torch.float32, TILES_B, 1.0),
     (torch.float16, TILES_A, 0.5)],
    ids=["fp32-A-p2", "fp16-B-p2", "fp32-B-p1", "fp16-A-p0.5"],
)
def test_skip_on_and_off_agree_with_batches_gqa_tq_below_tk_and_tiles_per_kernel(device, dtype, tiles, power):
    """Every kernel with tiles of its own (non-square; the forward's map read at coarser and finer tiles),
    two batches with different maps, 4 query heads on 2 kv heads, Tq = 56 < Tk = 80: the maps' batch,
    head and row indices must all be right for skip on and off to agree bit for bit."""
    gen = generator("skip-tiles", device, dtype, tiles, power)
    qs, ks, vs = [], [], []
    for _ in range(2):
        (q, k, v), beta = _sparse_inputs(gen, device, torch.float32, 80, 16)
        qs.append(torch.cat([q, q.flip(-2)], dim=1)[:, :, 24:])  # (1, 4, 56, 16)
        ks.append(k)
        vs.append(v)
    q, k, v = (torch.cat(x).to(dtype).contiguous() for x in (qs, ks, vs))  # (2, 4 or 2, T, 16)
    k[1] = k[1].flip(-2)  # batch 1's map differs from batch 0's
    beta = torch.cat([beta, beta.flip(0)])
    dout = randn(gen, 2, 4, 56, 16, device=device).to(dtype)
    results = []
    for skip in (False, True):
        cfgs = KernelConfigs(*(BlockConfig(m, n, skip_zero=skip) for m, n in tiles))
        out, live = triton_forward(q, k, v, beta, power, 1.0, cfgs)  # the backward regrains the forward's map
        results.append((out, *triton_backward(q, k, v, beta, power, 1.0, dout, True, cfgs, live=live)))
    for a, b in zip(*results):
        assert torch.equal(a, b), "a skipped tile must only leave out exact zeros"


def _kernel_lists(live: torch.Tensor, grain: tuple[int, int], bm: int, bn: int, tq: int, tk: int, by_key: bool) -> list[list[int]]:
    """The work lists as the kernels' dense unmasked loops would visit them, tile by tile in plain Python:
    a tile is listed when any map tile of `grain` it overlaps is live."""
    gm, gn = grain
    n_m, n_n = -(-tq // bm), -(-tk // bn)
    past = tk - tq

    def alive(r: int, i: int, j: int) -> bool:
        return bool(live[r, i * bm // gm: ((i + 1) * bm - 1) // gm + 1, j * bn // gn: ((j + 1) * bn - 1) // gn + 1].any())

    rows = []
    for r in range(live.shape[0]):
        if by_key:  # threshold_bwd_dkv_kernel: query tiles from m_full on
            for j in range(n_n):
                m_full = min(-(-max(j * bn + bn - 1 - past, 0) // bm) * bm, tq)
                rows.append([i for i in range(m_full // bm + (m_full % bm > 0), n_m) if alive(r, i, j)])
        else:  # threshold_fwd_kernel, threshold_bwd_dq_kernel: key tiles below n_full
            for i in range(n_m):
                n_full = (past + i * bm + 1) // bn * bn
                rows.append([j for j in range(n_full // bn) if alive(r, i, j)])
    return rows


@pytest.mark.parametrize("tq,tk", [(200, 200), (120, 200), (1, 128), (65, 128), (97, 97)])
@pytest.mark.parametrize("grain,block", [((16, 16), (16, 16)), ((16, 16), (32, 64)), ((16, 32), (64, 32)),
                                         ((64, 64), (32, 16)), ((32, 16), (16, 64))])
@pytest.mark.parametrize("by_key", [False, True], ids=["by_query", "by_key"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_tile_lists_hold_exactly_the_live_tiles_of_each_unmasked_loop(tq, tk, grain, block, by_key, device):
    """tile_lists (tile_lists_kernel) against the kernels' loop bounds written out in Python, on random maps:
    every live tile of the unmasked loop in ascending order (first `count` entries), nothing else, then 0s."""
    from lit_thresh.ops.triton_launch import tile_lists

    gen = generator("tile-lists", tq, tk, grain, block, by_key)
    live = (torch.rand(3, -(-tq // grain[0]), -(-tk // grain[1]), generator=gen) < 0.3).to(torch.int8)
    lists, counts = tile_lists(live.to(device), grain, BlockConfig(*block), tq, tk, by_key)
    lists, counts = lists.cpu(), counts.cpu()
    want = _kernel_lists(live, grain, *block, tq, tk, by_key)
    assert counts.tolist() == [len(row) for row in want]
    assert [lists[r, : len(row)].tolist() for r, row in enumerate(want)] == want
    assert all(not lists[r, len(row):].any() for r, row in enumerate(want))
    assert sum(map(len, want)) > 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("by_key", [False, True], ids=["by_query", "by_key"])
def test_tile_lists_of_long_rows_span_several_chunks(by_key, device):
    """Lists longer than one chunk of tile_lists_kernel (1024 tiles): the ranks carry over between chunks.
    by_query: one query tile after 2499 key tiles (Tq = 16, Tk = 16 x 2500). by_key: 1100 query tiles of 16,
    key tiles of 128 over a map of 16 x 64 tiles (two map columns per kernel tile, the last one past the
    map's end), the map a non-contiguous view."""
    from lit_thresh.ops.triton_launch import tile_lists

    gen = generator("tile-lists-long", by_key)
    if not by_key:
        tq, tk, grain, block = 16, 16 * 2500, (16, 16), (16, 16)
        live = (torch.rand(2, 1, tk // 16, generator=gen) < 0.5).to(torch.int8)  # (B * H, 1, 2500)
        want = [torch.nonzero(live[h, 0, :2499]).flatten().tolist() for h in range(2)]  # below the diagonal tile
    else:
        tq = tk = 16 * 1100
        grain, block = (16, 64), (16, 128)
        live = (torch.rand(1, 275, 1100, generator=gen) < 0.9).to(torch.int8).transpose(1, 2)  # (1, 1100, 275)
        pairs = F.pad(live[0].bool(), (0, 1)).view(1100, 138, 2).any(-1)  # (query tiles, key tiles of 128)
        # key tile n lists the query tiles from the first whose rows all see its keys: (128 n + 127) / 16 rounded up
        want = [(torch.nonzero(pairs[-(-(128 * n + 127) // 16):, n]).flatten() + -(-(128 * n + 127) // 16)).tolist()
                for n in range(138)]
    lists, counts = tile_lists(live.to(device), grain, BlockConfig(*block), tq, tk, by_key)
    lists, counts = lists.cpu(), counts.cpu()
    assert counts.tolist() == [len(row) for row in want] and max(counts.tolist()) > 1024
    assert [lists[r, : len(row)].tolist() for r, row in enumerate(want)] == want
    assert not any(lists[r, len(row):].any() for r, row in enumerate(want))


def test_tile_lists_refuse_a_map_of_another_shape_or_dtype():
    """A map too small for tq, tk would read as dead past its end (wrong gradients): refused, naming live."""
    from lit_thresh.ops.triton_launch import tile_lists

    with pytest.raises(ValueError, match=r"live must be an int8 map of shape \(B \* Hq, 2, 4\)"):
        tile_lists(torch.ones(1, 2, 3, dtype=torch.int8), (16, 16), BlockConfig(16, 16), 32, 64, by_key=False)
    with pytest.raises(ValueError, match="live must be an int8 map.*got torch.bool"):
        tile_lists(torch.ones(1, 2, 4, dtype=torch.bool), (16, 16), BlockConfig(16, 16), 32, 64, by_key=True)


def test_tile_lists_refuse_a_map_whose_tiles_do_not_nest_in_the_kernels():
    from lit_thresh.ops.triton_launch import tile_lists

    with pytest.raises(ValueError, match="divide or are multiples of the map's, got 32 and 48"):
        tile_lists(torch.ones(1, 2, 2, dtype=torch.int8), (48, 16), BlockConfig(32, 16), 96, 32, by_key=False)


def test_the_public_op_and_the_attention_variant_take_skip_zero(monkeypatch):
    """threshold_attention(..., skip_zero=True) and ThresholdAttention(skip_zero=True) reach the skipping
    kernels: the forward writes a map with tiles to skip, the backward skips by it (no pre-pass), and
    output and gradients are the same, bit for bit, as without it. A call with no gradient to record
    writes no map."""
    from lit_thresh.attention import ThresholdAttention
    from lit_thresh.ops import threshold_attention
    from lit_thresh.ops import triton_launch

    def no_prepass(*args):
        raise AssertionError("the backward must skip by the forward's map")

    maps, given = [], []
    real_fwd, real_bwd = triton_launch.triton_forward, triton_launch.triton_backward
    monkeypatch.setattr(triton_launch, "live_tiles", no_prepass)
    monkeypatch.setattr(triton_launch, "triton_forward", lambda *a, **kw: maps.append(real_fwd(*a, **kw)) or maps[-1])
    monkeypatch.setattr(triton_launch, "triton_backward", lambda *a, **kw: given.append(kw["live"]) or real_bwd(*a, **kw))
    gen = generator("skip-api")
    (q, k, v), beta = _sparse_inputs(gen, "cpu", torch.float32, 80, 16)
    dout = randn(gen, 1, 2, 80, 16)
    results = []
    for skip in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        out = threshold_attention(*leaves, backend="triton", skip_zero=skip)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    assert maps[0][1] is None and given[0] is None
    assert given[1] is maps[1][1] and not maps[1][1][:, 2:, 0].all()  # (B * H, 5, 5) at 16x16
    for a, b in zip(*results):
        assert torch.equal(a, b)

    maps.clear()
    x = randn(gen, 2, 96, 32)
    outs = []
    for skip in (False, True):
        torch.manual_seed(0)
        attn = ThresholdAttention(32, 2, beta=1.0, qk_norm=True, skip_zero=skip)
        outs.append(attn(x))
    assert maps[1][1] is not None and torch.equal(*outs) and outs[0].abs().sum() > 0
    assert not maps[1][1][:, 1:, 0].all(), "the model's maps must leave an unmasked tile to skip"  # (B * H, 3, 3)
    with torch.no_grad():
        threshold_attention(q, k, v, beta, backend="triton", skip_zero=True)
    assert maps[-1][1] is None


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_skip_zero_must_be_a_bool(value):
    from lit_thresh.attention import ThresholdAttention
    from lit_thresh.ops import threshold_attention

    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="skip_zero must be a bool"):
        threshold_attention(q, q, q, skip_zero=value)
    with pytest.raises(TypeError, match="skip_zero must be a bool"):
        ThresholdAttention(16, 2, skip_zero=value)
