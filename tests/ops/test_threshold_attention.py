"""threshold_attention (Triton kernels and the blockwise PyTorch path) against the float64 reference.

On CPU the Triton kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
the `gpu`-marked cases run the same checks on CUDA (`pytest -m gpu`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lit_thresh.ops import threshold_attention, triton_launch
from lit_thresh.ops.reference import threshold_attention_reference
from tests.ops.helpers import (
    TOLERANCE,
    check_against_reference,
    generator,
    randn,
    record_tma,
    reference_with_grads,
    rel_err,
)

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# (B, Hq, Hkv, Tq, Tk, D, Dv): odd lengths, non-power-of-two head dims, Tq < Tk, GQA, Dv != D.
SHAPES = [
    (1, 1, 1, 1, 1, 16, 16),
    (2, 2, 2, 17, 17, 48, 48),
    (1, 2, 1, 100, 100, 80, 80),
    (1, 1, 1, 129, 129, 128, 128),
    (2, 4, 2, 33, 100, 16, 48),
    (1, 3, 1, 1, 129, 64, 64),
    (1, 2, 2, 70, 70, 256, 32),
    (1, 1, 1, 65, 65, 8, 24),
]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_reference_over_shapes(device, shape, dtype):
    assert check_against_reference(device, dtype, "triton", *shape, beta="per_head", power=2.0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power", [0.5, 1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("beta", [-1.5, 0.0, 2.0, "scalar_tensor", "per_head"])
def test_triton_powers_and_betas(device, power, beta):
    assert check_against_reference(device, torch.float32, "triton", 2, 2, 1, 40, 57, 48, 48, beta=beta, power=power, scale=0.5)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power", [0.5, 1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_low_precision_powers(device, power, dtype):
    assert check_against_reference(device, dtype, "triton", 1, 2, 2, 50, 50, 32, 32, beta="per_head", power=power, scale=0.3)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", ["bthd", "sliced"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_non_contiguous_inputs(device, layout, dtype):
    assert check_against_reference(device, dtype, "triton", 2, 4, 2, 37, 45, 48, 48, beta="per_head", power=2.0, layout=layout)


@pytest.mark.parametrize("shape", SHAPES[:6], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_torch_path_matches_reference(shape, power, dtype):
    assert check_against_reference("cpu", dtype, "torch", *shape, beta="per_head", power=power, layout="bthd")


def test_fp16_does_not_overflow_where_the_result_is_finite():
    """Scores of ~300 give P = ReLU(s)^2 ~ 9e4 > 65504 (fp16 max); with small V the output is finite."""
    gen = generator("fp16-range")
    q = randn(gen, 1, 2, 64, 32, scale=4.0, dtype=torch.float16).requires_grad_()
    k = randn(gen, 1, 2, 64, 32, scale=4.0, dtype=torch.float16).requires_grad_()
    v = randn(gen, 1, 2, 64, 32, scale=1e-3, dtype=torch.float16).requires_grad_()
    scores = (q.double() @ k.double().transpose(-1, -2)).tril()
    assert scores.max() ** 2 > 65504, "the test must drive P out of fp16 range"
    out = threshold_attention(q, k, v, 0.5, 2.0, backend="triton")
    dout = randn(gen, *out.shape, scale=1e-3, dtype=torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_grads = reference_with_grads(q, k, v, 0.5, 2.0, 1.0, dout)
    assert ref.abs().max() < 65504 and all(r.abs().max() < 65504 for r in ref_grads)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_err(out, ref) < TOLERANCE[torch.float16]
    assert all(rel_err(g, r) < TOLERANCE[torch.float16] for g, r in zip(grads, ref_grads))


def test_masked_keys_contribute_nothing_for_negative_beta():
    """With beta < 0, ReLU(0 - tau) > 0: a leaking mask would show up as output from future keys."""
    gen = generator("future")
    q, k, v = (randn(gen, 1, 1, 20, 16) for _ in range(3))
    v_future = v.clone()
    v_future[..., 10:, :] += 100.0
    for backend in ("triton", "torch"):
        a = threshold_attention(q, k, v, -3.0, 2.0, backend=backend)
        b = threshold_attention(q, k, v_future, -3.0, 2.0, backend=backend)
        torch.testing.assert_close(a[..., :10, :], b[..., :10, :], rtol=0, atol=0)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (64, 16), (16, 64)])
def test_triton_block_shapes(blocks):
    """Diagonal-block logic with BLOCK_M != BLOCK_N, called through the launchers directly."""
    from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs, triton_backward, triton_forward

    cfg = BlockConfig(*blocks)
    configs = KernelConfigs(cfg, cfg, cfg)
    gen = generator("blocks", blocks)
    q, k, v = randn(gen, 1, 2, 77, 32), randn(gen, 1, 1, 90, 32), randn(gen, 1, 1, 90, 16)
    beta = randn(gen, 2)
    out, _ = triton_forward(q, k, v, beta, 1.5, 0.7, configs)
    dout = randn(gen, *out.shape)
    dq, dk, dv, dbeta = triton_backward(q, k, v, beta, 1.5, 0.7, dout, True, configs)
    ref, (rq, rk, rv, rb) = reference_with_grads(q, k, v, beta, 1.5, 0.7, dout)
    for got, want in ((out, ref), (dq, rq), (dk, rk), (dv, rv), (dbeta, rb)):
        assert rel_err(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dbeta_is_deterministic(backend):
    gen = generator("det", backend)
    q, k, v = (randn(gen, 2, 2, 50, 16) for _ in range(3))
    beta = torch.tensor([0.3, -0.2], requires_grad=True)

    def dbeta():
        return torch.autograd.grad(threshold_attention(q, k, v, beta, 2.0, backend=backend).sum(), beta)[0]

    assert torch.equal(dbeta(), dbeta())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_saves_only_inputs_no_quadratic_state(backend):
    """Autograd keeps q, k, v and beta: nothing of size Tq x Tk, no fp32 copies of bf16 inputs."""
    gen = generator("saved", backend)
    q, k, v = (randn(gen, 1, 2, 200, 16, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        threshold_attention(q, k, v, 1.0, 2.0, backend=backend)
    assert sorted(t.numel() for t in saved) == [2, 6400, 6400, 6400]
    assert all(t.dtype == torch.bfloat16 for t in saved if t.numel() > 2)


def test_torch_path_never_materialises_the_score_matrix():
    """Every intermediate of the blockwise path, forward and backward, is O(T * block), not O(T^2)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_thresh.ops.chunked import QUERY_BLOCK, chunked_backward, chunked_forward

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, t.numel())
            return out

    t = 4 * QUERY_BLOCK
    q, k, v, dout = (torch.randn(1, 1, t, 16) for _ in range(4))
    beta = torch.ones(1)
    with LargestTensor():  # the op's bodies (a mode sees the custom op as one call, not what it runs)
        chunked_forward(q, k, v, beta, 2.0, 1.0)
        chunked_backward(q, k, v, beta, 2.0, 1.0, dout, True)
    assert LargestTensor.largest == QUERY_BLOCK * t  # one block of scores: (block, T), never (T, T)


def test_autocast_casts_inputs_to_the_autocast_dtype():
    gen = generator("autocast")
    q, k, v = (randn(gen, 1, 2, 20, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = threshold_attention(q, k, v.bfloat16(), 1.0, 2.0)  # mixed dtypes are fine under autocast
    assert out.dtype == torch.bfloat16
    ref = threshold_attention_reference(*(t.bfloat16().double() for t in (q, k, v)), 1.0, 2.0)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_beta_gradient_has_beta_shape():
    """A scalar beta tensor gets a scalar gradient; a (H,) beta gets (H,)."""
    gen = generator("beta-shape")
    q, k, v = (randn(gen, 1, 3, 9, 16) for _ in range(3))
    for beta in (torch.tensor(0.5, requires_grad=True), torch.full((3,), 0.5, requires_grad=True)):
        (g,) = torch.autograd.grad(threshold_attention(q, k, v, beta).sum(), beta)
        assert g.shape == beta.shape


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [1000, 1500, 2100])  # triton_launch.length_class 0, 1 and 2
@pytest.mark.parametrize("loads", ["pointers", "tma"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_default_tiles_at_training_sizes(head_dim, dtype, loads, seq_len, monkeypatch):
    """The tuned tiles of default_configs (the interpreter runs small ones) for short and long maps: many
    full tiles and a partial last one, GQA, per-head beta; loading through pointers, as an eager call of this
    size does, and through TMA descriptors where the config has them, as a larger call or a CUDA graph does
    (TMA_MIN_WORK)."""
    if loads == "tma":
        monkeypatch.setattr(triton_launch, "TMA_MIN_WORK", 0)
    assert check_against_reference("cuda", dtype, "triton", 2, 4, 2, seq_len, seq_len, head_dim, head_dim,
                                   beta="per_head", power=2.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_tiles_by_key_length(head_dim, dtype, monkeypatch):
    """Short maps (Tk <= 1024, then <= 2048) get their own forward and dK/dV tiles where the H100 A/B found
    them faster (PERF.md v21), the dQ tiles never change, skip_zero's tiles (the map's grain) never do, and
    a call's plan follows its key length, not its query length (decoding)."""
    monkeypatch.setattr(triton_launch, "triton_interpreting", lambda: False)  # the GPU's tiles
    long = triton_launch.default_configs(head_dim, dtype)
    by_len = {tk: triton_launch.default_configs(head_dim, dtype, tk) for tk in (1, 1024, 1025, 2048, 2049, 16384)}
    assert by_len[1] == by_len[1024] and by_len[1025] == by_len[2048] and by_len[2049] == by_len[16384] == long
    assert all(c.bwd_dq == long.bwd_dq for c in by_len.values())
    short_fwd = triton_launch.BlockConfig(64, 64, 4, 3, tma=True)
    short_dkv = triton_launch.BlockConfig(32, 64, 4, 3, tma=True)
    if head_dim == 128:
        assert (by_len[1024].fwd, by_len[2048].fwd, long.fwd.block_m) == (short_fwd, short_fwd, 128)
        assert (by_len[1024].bwd_dkv, by_len[2048].bwd_dkv) == (short_dkv, long.bwd_dkv)
    else:
        assert by_len[1024].fwd == long.fwd
        assert by_len[1024].bwd_dkv == (short_dkv if dtype == torch.float16 else long.bwd_dkv)
    skip = triton_launch.skip_zero_configs(head_dim, dtype)
    assert skip == type(long)(*(replace(c, skip_zero=True) for c in (long.fwd, long.bwd_dkv, long.bwd_dq)))
    q = torch.empty(1, 2, 1, head_dim, dtype=dtype)  # (B, H, Tq, D): one query, as in decoding
    for tk in (1000, 4000):
        k = torch.empty(1, 2, tk, head_dim, dtype=dtype)
        (fwd, _), (dkv, _), _ = triton_launch._problem_plan(q, k, k, 2.0, None)
        assert (fwd, dkv) == (replace(by_len[16384 if tk > 2048 else 1].fwd, tma=False),
                              replace(by_len[16384 if tk > 2048 else 1].bwd_dkv, tma=False))  # a small call: pointers
    skip_plans = [triton_launch._problem_plan(q, torch.empty(1, 2, tk, head_dim, dtype=dtype), q, 2.0, None, True)
                  for tk in (1000, 2000, 4000)]
    assert all(p is skip_plans[0] for p in skip_plans), "skip_zero's plan is one cached entry at every key length"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_default_tiles_with_tma_on_transposed_views(head_dim, dtype, monkeypatch):
    """The default tiles with their TMA loads forced on, on (B, T, H, D) views at an odd length; the loads do
    go through descriptors."""
    monkeypatch.setattr(triton_launch, "TMA_MIN_WORK", 0)
    used = record_tma(monkeypatch, triton_launch)
    assert check_against_reference("cuda", dtype, "triton", 2, 4, 2, 333, 333, head_dim, head_dim, beta="per_head",
                                   power=2.0, layout="bthd")
    assert any(used), "some kernel must have loaded through TMA descriptors"


def test_eager_calls_below_tma_min_work_load_through_pointers():
    """The default tiles drop TMA loads for calls of less work than TMA_MIN_WORK, B * Hq * Tq * Tk * max(D, Dv),
    and keep them from it on (CPU tensors: never captured into a CUDA graph)."""
    side = int((triton_launch.TMA_MIN_WORK // (16 * 128)) ** 0.5)  # (1, 16, side, 128): TMA_MIN_WORK
    assert 16 * side * side * 128 == triton_launch.TMA_MIN_WORK
    q = torch.empty(1, 16, side, 128, device="meta")
    assert triton_launch.default_tma(q, q, q)
    assert not triton_launch.default_tma(q[:, :, 1:], q, q)  # one query fewer
    assert not triton_launch.default_tma(q[..., :64], q[..., :64], q[..., :64])  # half the head dim
    assert triton_launch.default_tma(q[..., :64], q[..., :64], q)  # Dv counts as well
    configs = [cfg for cfg, _ in triton_launch._plan(64, 64, torch.bfloat16, 2.0, "ieee", False, None, False, True)]
    assert any(cfg.tma for cfg in configs), "the bf16 D = 64 defaults load some tiles through TMA"
    pointer = [cfg for cfg, _ in triton_launch._plan(64, 64, torch.bfloat16, 2.0, "ieee", False, None, False, False)]
    assert pointer == [replace(cfg, tma=False) for cfg in configs]


def test_the_launchers_plan_picks_the_loads_by_the_calls_work(monkeypatch):
    """_problem_plan, as the launchers call it, passes default_tma's choice on to the default tiles."""
    q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(triton_launch, "triton_interpreting", lambda: False)  # the GPU's tuned tiles
    small = [cfg.tma for cfg, _ in triton_launch._problem_plan(q, q, q, 2.0, None)]
    monkeypatch.setattr(triton_launch, "TMA_MIN_WORK", 0)
    large = [cfg.tma for cfg, _ in triton_launch._problem_plan(q, q, q, 2.0, None)]
    assert not any(small) and any(large)


@pytest.mark.gpu
def test_calls_captured_into_a_cuda_graph_keep_tma():
    """A small call being captured into a CUDA graph pays the descriptors' host time once: TMA stays on."""
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    assert not triton_launch.default_tma(q, q, q)
    eager = threshold_attention(q, q, q, 0.5)  # compiles the pointer kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_launch.default_tma(q, q, q)
        out = threshold_attention(q, q, q, 0.5)
    graph.replay()
    assert captured
    assert rel_err(out, eager) < TOLERANCE[torch.bfloat16]


def test_gain_table_is_tau_over_beta_in_fp32_cached_grown_and_outgrown_tables_kept(monkeypatch):
    """gain_table: sqrt(2 ln(pos + 1) / d) rounded once to fp32, at least n long (a power of 2), the same tensor
    while it is long enough, a longer one when it is not; the outgrown one stays alive (a CUDA graph may read it)."""
    from lit_thresh.ops.reference import threshold_gain

    monkeypatch.setattr(triton_launch, "_GAIN_TABLES", {})
    monkeypatch.setattr(triton_launch, "_RETIRED_GAIN_TABLES", [])
    cpu = torch.device("cpu")
    table = triton_launch.gain_table(cpu, 40, 100)
    assert table.dtype == torch.float32 and table.numel() == 128
    assert torch.equal(table, threshold_gain(torch.arange(128), 40, torch.float64).float())
    assert triton_launch.gain_table(cpu, 40, 128) is table  # cached
    longer = triton_launch.gain_table(cpu, 40, 129)
    assert longer.numel() == 256 and torch.equal(longer[:128], table)
    assert triton_launch.gain_table(cpu, 40, 5) is longer
    assert triton_launch._RETIRED_GAIN_TABLES == [table]
    assert triton_launch.gain_table(cpu, 64, 5) is not longer  # per head dim


@pytest.mark.parametrize("case", ["single-fp32", "single-fp16", "single-skip_zero", "single-prepass", "differential"])
def test_every_kernel_reads_tau_from_the_gain_table(case, monkeypatch):
    """The kernels take tau's position factor from the launcher's table, nowhere else: with a table of zeros
    (the cache left alone) the forward and every gradient are the reference's at beta = 0, and dbeta is 0.
    beta is large, so tau computed any other way would zero almost every weight and tile; the cases reach the
    fp16 row bounds, the forward's skip_zero map and the backward's pre-pass (live_tiles)."""
    from lit_thresh.ops import differential_threshold_attention, triton_differential
    from lit_thresh.ops.reference import differential_threshold_attention_reference

    def zeros(device, d, n):
        return torch.zeros(1 << max(n - 1, 1).bit_length(), device=device)

    monkeypatch.setattr(triton_launch, "gain_table", zeros)
    monkeypatch.setattr(triton_differential, "gain_table", zeros)
    dtype = torch.float16 if case == "single-fp16" else torch.float32
    gen = generator("gain-table", case)
    inputs = [randn(gen, 1, 2, 45, 16, dtype=dtype).requires_grad_() for _ in range(5 if case == "differential" else 3)]
    beta = torch.tensor([50.0, 30.0], requires_grad=True)  # tau >= 8.8 past position 0; scores have std 4
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    beta0 = torch.zeros(2, dtype=torch.float64)
    dout = randn(gen, 1, 2, 45, 16, dtype=dtype)
    if case == "differential":
        out = differential_threshold_attention(*inputs, beta, 0.4, 2.0, backend="triton")
        ref = differential_threshold_attention_reference(*ref_inputs, beta0, 0.4, 2.0, normalize=False)
    elif case == "single-prepass":  # the backward without the forward's map makes its own (live_tiles)
        q, k, v = inputs
        configs = triton_launch.skip_zero_configs(16, dtype)
        out, _ = triton_launch.triton_forward(q, k, v, beta.detach(), 2.0, 1.0, configs)
        dq, dk, dv, dbeta = triton_launch.triton_backward(q, k, v, beta.detach(), 2.0, 1.0, dout, True, configs)
        ref = threshold_attention_reference(*ref_inputs, beta0, 2.0)
    else:
        out = threshold_attention(*inputs, beta, 2.0, backend="triton", skip_zero=case == "single-skip_zero")
        ref = threshold_attention_reference(*ref_inputs, beta0, 2.0)
    if case != "single-prepass":
        *grads, dbeta = torch.autograd.grad(out, [*inputs, beta], dout)
    else:
        grads = [dq, dk, dv]
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert all(rel_err(g, r) < TOLERANCE[dtype] for g, r in zip(grads, ref_grads))
    assert torch.equal(dbeta, torch.zeros_like(dbeta))


@pytest.mark.gpu
def test_a_gain_table_first_needed_in_a_cuda_graph_capture_is_not_cached():
    """A table made while a graph is being captured has its values only when the graph runs: the replay is
    right, and the cache does not keep it for eager calls."""
    d = 40
    q = torch.randn(1, 2, 128, d, device="cuda")
    eager = threshold_attention(q, q, q, 0.5)  # compiles the kernels outside the capture
    triton_launch._GAIN_TABLES.pop((q.device, d))  # as if no call had needed the table yet
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = threshold_attention(q, q, q, 0.5)
    assert (q.device, d) not in triton_launch._GAIN_TABLES
    graph.replay()
    assert rel_err(out, eager) < TOLERANCE[torch.float32]
    assert (q.device, d) not in triton_launch._GAIN_TABLES


@pytest.mark.gpu
def test_a_graph_still_replays_right_after_its_gain_table_is_outgrown():
    """A graph captured with one table keeps reading it after a longer call replaces it in the cache: the
    outgrown table stays alive, and the replay is right."""
    d = 24
    q = torch.randn(1, 2, 100, d, device="cuda")
    triton_launch._GAIN_TABLES.pop((q.device, d), None)
    eager = threshold_attention(q, q, q, 0.5)  # makes and caches the table, compiles the kernels
    table = triton_launch._GAIN_TABLES[(q.device, d)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = threshold_attention(q, q, q, 0.5)
    long = torch.randn(1, 2, 3000, d, device="cuda")
    threshold_attention(long, long, long, 0.5)  # outgrows the table the graph reads
    assert triton_launch._GAIN_TABLES[(q.device, d)] is not table
    assert any(old is table for old in triton_launch._RETIRED_GAIN_TABLES)
    torch.cuda.empty_cache()
    torch.randn(1 << 20, device="cuda")  # reuse freed memory, if the old table had been freed
    graph.replay()
    assert rel_err(out, eager) < TOLERANCE[torch.float32]


@pytest.mark.gpu
def test_a_gain_table_made_in_a_compiled_warm_up_lies_outside_the_cuda_graph_pool():
    """torch.compile's CUDA-graph warm-up sends the calling thread's allocations into its graphs' pool, whose
    state it may reset under a live tensor: a table cached then must come from the default pool (id (0, 0))."""
    d = 56
    q = torch.randn(1, 2, 128, d, device="cuda")
    compiled = torch.compile(lambda x: threshold_attention(x, x, x, 0.5), mode="reduce-overhead", fullgraph=True)
    eager = threshold_attention(q, q, q, 0.5)
    triton_launch._GAIN_TABLES.pop((q.device, d))
    out = compiled(q)  # the first run is a warm-up inside the graphs' pool
    table = triton_launch._GAIN_TABLES[(q.device, d)]
    segment = next(s for s in torch.cuda.memory_snapshot()
                   if s["address"] <= table.data_ptr() < s["address"] + s["total_size"])
    assert segment["segment_pool_id"] == (0, 0)
    assert rel_err(out, eager) < TOLERANCE[torch.float32]
