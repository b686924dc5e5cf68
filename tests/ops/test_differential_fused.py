"""The fused differential_threshold_attention (Triton kernels and the blockwise PyTorch path) against a float64
reference built from threshold_attention_reference (helpers.differential_reference): forward and every gradient
(q1, q2, k1, k2, v, beta, lambda).

On CPU the Triton kernels run through the Triton interpreter (tests/conftest.py), so those cases are tiny;
the `gpu`-marked cases run realistic sizes on CUDA (`pytest -m gpu`).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_thresh.attention import DiffThresholdAttention
from lit_thresh.ops import differential_threshold_attention, differential_threshold_rela_triton, threshold_attention
from lit_thresh.ops import triton_differential as td
from lit_thresh.ops.differential_function import (
    differential_threshold_attention_apply,
    differential_threshold_attention_backward_op,
    differential_threshold_attention_op,
)
from lit_thresh.ops.reference import threshold_attention_weights
from lit_thresh.ops.triton_differential import diff_triton_backward, diff_triton_forward
from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs
from tests.ops.helpers import (
    SUBLINEAR_GRAD_TOLERANCE,
    TOLERANCE,
    differential_reference,
    generator,
    laid_out,
    randn,
    record_tma,
    rel_err,
)
from tests.ops.sm90 import run_without_interpreter

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
GRADS = ("dq1", "dq2", "dk1", "dk2", "dv", "dbeta", "dlam")


def make_inputs(gen, device, dtype, b, hq, hkv, tq, tk, d, dv, beta, lam, layout="bhtd"):
    """q1, q2, k1, k2, v (requiring grad) in the layout asked for, and beta, lam as a float, a 0-d
    tensor ('scalar'), an (Hq,) tensor ('per_head') or an (Hq,) strided view ('strided'); both are
    drawn in [-0.5, 1.5] (lam unclamped)."""

    def make(h, t, dim):
        return laid_out(gen, layout, b, h, t, dim, dtype, device)

    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def scalar(kind, low, high):
        if kind in ("per_head", "strided"):
            values = (low + (high - low) * torch.rand(2 * hq, generator=gen, dtype=param_dtype)).to(device)
            return (values[::2] if kind == "strided" else values[:hq]).requires_grad_()
        if kind == "scalar":
            return torch.tensor(0.5 * (low + high), dtype=param_dtype, device=device).requires_grad_()
        return kind  # a float

    qkv = [make(hq, tq, d), make(hq, tq, d), make(hkv, tk, d), make(hkv, tk, d), make(hkv, tk, dv)]
    return qkv, scalar(beta, -0.5, 1.5), scalar(lam, -0.5, 1.5)


def check(device, dtype, backend, b, hq, hkv, tq, tk, d, dv, beta="per_head", lam="per_head", power=2.0, scale=0.7,
          layout="bhtd") -> None:
    """Forward and every gradient against the float64 reference, by relative error norm."""
    gen = generator("diff_fused", device, dtype, backend, b, hq, hkv, tq, tk, d, dv, beta, lam, power, scale, layout)
    qkv, beta, lam = make_inputs(gen, device, dtype, b, hq, hkv, tq, tk, d, dv, beta, lam, layout)
    out = differential_threshold_attention(*qkv, beta, lam, power, scale=scale, backend=backend)
    assert out.shape == (b, hq, tq, dv) and out.dtype == dtype
    dout = randn(gen, b, hq, tq, dv, dtype=dtype, device=device)
    wrt = qkv + [t for t in (beta, lam) if isinstance(t, torch.Tensor)]
    grads = torch.autograd.grad(out, wrt, dout)
    assert all(g.shape == t.shape and g.dtype == t.dtype for g, t in zip(grads, wrt))

    ref_wrt = [t.detach().double().requires_grad_() for t in wrt]
    it = iter(ref_wrt[5:])  # the tensor ones of beta, lam
    ref_beta = next(it) if isinstance(beta, torch.Tensor) else beta
    ref_lam = next(it) if isinstance(lam, torch.Tensor) else lam
    ref = differential_reference(*ref_wrt[:5], ref_beta, ref_lam, power, scale)
    ref_grads = torch.autograd.grad(ref, ref_wrt, dout.double())

    # No kernel beats the exact result rounded to the input dtype: that rounding error is added to each bound.
    floors = [rel_err(r.to(t.dtype), r) for r, t in zip((ref, *ref_grads), (out, *wrt))]
    assert all(math.isfinite(f) for f in floors)
    assert rel_err(out, ref) < TOLERANCE[dtype] + floors[0], f"out: {rel_err(out, ref):.2e}"
    grad_tol = (SUBLINEAR_GRAD_TOLERANCE if power < 1 else TOLERANCE)[dtype]
    names = GRADS[:5] + tuple(n for n, t in zip(GRADS[5:], (beta, lam)) if isinstance(t, torch.Tensor))
    errors = {n: rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)}
    assert all(errors[n] < grad_tol + f for n, f in zip(names, floors[1:])), f"tolerance {grad_tol}: {errors}"


# (B, Hq, Hkv, Tq, Tk, D, Dv): T = 1, odd lengths, non-power-of-two head dims, Tq < Tk, GQA, Dv != D.
TORCH_SHAPES = [
    (1, 1, 1, 1, 1, 24, 24),
    (2, 4, 2, 37, 37, 24, 48),
    (1, 2, 1, 20, 70, 80, 64),
    (2, 2, 2, 70, 70, 64, 80),
]
TRITON_SHAPES = [
    (1, 1, 1, 1, 1, 16, 16),
    (1, 2, 1, 37, 37, 24, 40),
    (1, 2, 2, 9, 40, 80, 24),
]


@pytest.mark.parametrize("shape", TORCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("power", [1.0, 2.0, 1.5])
def test_torch_backend_float64(shape, power):
    check("cpu", torch.float64, "torch", *shape, power=power)


@pytest.mark.parametrize("beta,lam", [(0.3, -0.4), ("scalar", "scalar"), ("per_head", 1.3), (-1.0, "per_head")])
@pytest.mark.parametrize("layout", ["bhtd", "bthd", "sliced"])
def test_torch_backend_parameter_forms_and_layouts(beta, lam, layout):
    check("cpu", torch.float64, "torch", 2, 4, 2, 21, 30, 24, 24, beta=beta, lam=lam, power=1.5, layout=layout)


def test_torch_backend_float32():
    check("cpu", torch.float32, "torch", 2, 4, 1, 33, 50, 24, 40, power=2.0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_backend_shapes_and_dtypes(device, shape, dtype):
    check(device, dtype, "triton", *shape)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("power,beta,lam", [(1.0, 0.2, "scalar"), (1.5, "scalar", 0.6), (2.0, "strided", "strided")])
def test_triton_backend_powers_and_parameter_forms(device, power, beta, lam):
    check(device, torch.float32, "triton", 1, 2, 1, 20, 33, 16, 16, beta=beta, lam=lam, power=power)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout,dtype", [("bthd", torch.float32), ("sliced", torch.bfloat16)], ids=str)
def test_triton_backend_non_contiguous(device, layout, dtype):
    check(device, dtype, "triton", 1, 2, 1, 19, 19, 16, 24, layout=layout)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_triton_backend_mixed_layouts(device, monkeypatch):
    """q1 and q2 (k1 and k2) with different strides: the kernels take one set per pair, so one tensor of each
    pair is copied into the other's layout, once: forward and backward read the same copy. Outputs and
    gradients match the reference; the inputs' .grad keep their layouts."""
    gen = generator("diff_mixed", device)
    q1 = randn(gen, 1, 9, 2, 16, device=device).transpose(1, 2).requires_grad_()  # (B, H, T, D) view of (B, T, H, D)
    k2 = randn(gen, 1, 9, 2, 16, device=device).transpose(1, 2).requires_grad_()
    q2, k1, v = (randn(gen, *shape, device=device).requires_grad_() for shape in ((1, 2, 9, 16), (1, 2, 9, 16), (1, 2, 9, 8)))
    lam = torch.tensor([0.4, 1.2], device=device)
    seen = []  # (q1, q2, k1, k2) as each launcher gets them

    def recording(launch):
        def wrapper(*args, **kwargs):
            seen.append(args[:4])
            return launch(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(td, "diff_triton_forward", recording(td.diff_triton_forward))
    monkeypatch.setattr(td, "diff_triton_backward", recording(td.diff_triton_backward))
    out = differential_threshold_attention(q1, q2, k1, k2, v, 0.1, lam, backend="triton")
    dout = randn(gen, *out.shape, device=device)
    out.backward(dout)
    (fq1, fq2, fk1, fk2), (bq1, bq2, bk1, bk2) = seen
    assert fq1 is q1 and fk1 is k1  # the first of a pair keeps its (dense) layout ...
    assert fq2.stride() == q1.stride() and fk2.stride() == k1.stride()  # ... the second is copied into it
    assert all(f is b for f, b in zip((fq1, fq2, fk1, fk2), (bq1, bq2, bk1, bk2)))  # backward reads the same copies

    inputs64 = [t.detach().double().requires_grad_() for t in (q1, q2, k1, k2, v)]
    ref = differential_reference(*inputs64, 0.1, lam.double(), 2.0, 1.0)
    ref_grads = torch.autograd.grad(ref, inputs64, dout.double())
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    for t, r in zip((q1, q2, k1, k2, v), ref_grads):
        assert rel_err(t.grad, r) < TOLERANCE[torch.float32] and t.grad.stride() == t.stride()


def test_match_strides_copies_at_most_one_of_a_pair():
    """The dense tensor's layout is kept and the other copied into it; strides that differ only in dims of
    size 1 are no difference; two non-dense tensors are both made contiguous."""
    gen = generator("diff_match_strides")
    dense_t = randn(gen, 2, 7, 3, 8).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
    plain = randn(gen, 2, 3, 7, 8)
    sliced = randn(gen, 2, 3, 14, 11)[:, :, ::2, 1:9]
    sliced_other = randn(gen, 2, 3, 7, 12)[..., 2:10]
    for a, b, kept in ((dense_t, plain, "a"), (sliced, plain, "b"), (plain, sliced, "a"), (sliced, sliced_other, None)):
        a2, b2 = td.match_strides(a, b)
        assert a2.stride() == b2.stride() and torch.equal(a2, a) and torch.equal(b2, b)
        assert (a2 is a) == (kept == "a") and (b2 is b) == (kept == "b")
        if kept is None:
            assert a2.is_contiguous() and b2.is_contiguous()
    one_head = randn(gen, 2, 1, 7, 8)
    other_head_stride = one_head.as_strided(one_head.shape, (56, 999, 8, 1))  # the head stride is never stepped over
    pair = td.match_strides(one_head, other_head_stride)
    assert pair[0] is one_head and pair[1] is other_head_stride


@pytest.mark.parametrize("backend,dtype,layout", [("torch", torch.float64, "bthd"), ("triton", torch.float32, "sliced")])
def test_eager_path_and_custom_op_agree(backend, dtype, layout):
    """Eager calls skip the op's dispatch (an autograd.Function on the same code): same values, strides and
    gradients (q1, q2, k1, k2, v, beta, lambda) as the custom op; the public function takes the eager path."""
    args = _op_args(backend, dtype, layout)
    eager = differential_threshold_attention(*args[:7], args[7], scale=args[8], backend=backend)
    assert "Eager" in type(eager.grad_fn).__name__
    outs = [differential_threshold_attention_apply(*args), differential_threshold_attention_op(*args), eager]
    dout = randn(generator("diff_agree", backend), *outs[0].shape, dtype=dtype)
    grads = [torch.autograd.grad(out, args[:7], dout) for out in outs]
    for out, out_grads in zip(outs[1:], grads[1:]):
        assert torch.equal(outs[0], out) and outs[0].stride() == out.stride()
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(grads[0], out_grads))
    assert all(g.abs().max() > 0 for g in grads[0])


def test_compiled_call_is_one_op_and_matches_eager():
    """torch.compile(fullgraph=True) traces the op (with a q pair of different layouts, copied before it) as one
    node per direction, without a graph break; values and gradients equal the eager call's."""
    gen = generator("diff_compiled")
    qkv, beta, lam = make_inputs(gen, "cpu", torch.float32, 1, 2, 1, 6, 6, 16, 8, "per_head", "per_head")
    qkv[0] = qkv[0].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # q1: (B, T, H, D) memory
    fn = lambda *a: differential_threshold_attention(*a, backend="triton")  # noqa: E731
    counter = CompileCounterWithBackend("aot_eager")
    outs = [fn(*qkv, beta, lam), torch.compile(fn, backend=counter, fullgraph=True)(*qkv, beta, lam)]
    assert counter.frame_count == 1
    targets = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.lit_thresh.differential_threshold_attention.default) == 1
    dout = randn(gen, *outs[0].shape)
    grads = [torch.autograd.grad(out, [*qkv, beta, lam], dout) for out in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["small calls'", "large calls'"])
@pytest.mark.parametrize("d,dv", [(64, 64), (64, 128), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_realistic_sizes_gpu(d, dv, dtype, tiles, monkeypatch):
    """The default tiles at training sizes, those of calls below large_call's threshold and, with the threshold
    set to 0, those of large calls (v25: some load through TMA descriptors)."""
    if tiles == "large calls'":
        from lit_thresh.ops import triton_launch

        monkeypatch.setattr(triton_launch, "TMA_MIN_WORK", 0)
    check("cuda", dtype, "triton", 2, 4, 2, 1024, 1024, d, dv, scale=d**-0.5)  # fp16: sums stay in range


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_skip_zero_tiles_change_nothing(device):
    """With BlockConfig.skip_zero the kernels skip tiles where both rectified maps are all 0: same results,
    bit for bit, on inputs where most tiles are all 0 and some are not."""
    gen = generator("diff_skip", device)
    t, d = 48, 16
    q1, q2, k1, k2 = (F.normalize(randn(gen, 1, 2, t, d, dtype=torch.float64), dim=-1) for _ in range(4))
    k1[:, :, 3], k2[:, :, 20] = q1[:, :, 44], q2[:, :, 30]  # two scores of 1, above tau; the rest mostly below
    q1, q2, k1, k2 = (x.float().to(device) for x in (q1, q2, k1, k2))
    v = randn(gen, 1, 2, t, d, device=device)
    beta = torch.tensor([1.2, 1.4], device=device)
    live = sum(threshold_attention_weights(q, k, beta, 2.0).ne(0) for q, k in ((q1, k1), (q2, k2)))  # (1, 2, T, T)
    live_tiles = live.unflatten(-1, (t // 16, 16)).unflatten(-3, (t // 16, 16)).sum((-1, -3)).ne(0)  # (1, 2, 3, 3)
    causal_tiles = live_tiles[..., torch.ones(t // 16, t // 16, dtype=torch.bool, device=device).tril()]
    assert causal_tiles.any() and not causal_tiles.all()  # some tiles are skipped, some are not
    lam = torch.tensor([0.7, -0.3], device=device)
    dout = randn(gen, 1, 2, t, d, device=device)
    results = []
    for skip in (False, True):
        cfg = BlockConfig(16, 16, skip_zero=skip)
        cfgs = KernelConfigs(cfg, cfg, cfg)
        out = diff_triton_forward(q1, q2, k1, k2, v, beta, lam, 2.0, 1.0, cfgs)
        results.append([out, *diff_triton_backward(q1, q2, k1, k2, v, beta, lam, 2.0, 1.0, dout, True, True, cfgs)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    ref = differential_reference(q1.double(), q2.double(), k1.double(), k2.double(), v.double(), beta.double(),
                                 lam.double(), 2.0, 1.0)
    assert ref.abs().max() > 0 and rel_err(results[1][0], ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype,power,skip", [(torch.float32, 2.0, False), (torch.float16, 2.0, False),
                                              (torch.float16, 0.5, False), (torch.bfloat16, 1.0, True)], ids=str)
def test_dk_dv_in_two_launches_matches_one_launch_and_the_reference(device, dtype, power, skip):
    """KernelConfigs.bwd_dk2: the dK/dV kernel runs twice, dK1 and dV at bwd_dkv's tiles, then dK2 at bwd_dk2's;
    with split_maps, dK1 and map 1's term of dV, then dK2 and map 2's term added. At the same tiles every gradient
    equals the single launch's bit for bit, except split_maps' dV (rounded once more); at other tiles every
    gradient matches the float64 reference. GQA, odd lengths, Tq < Tk, Dv != D; fp16 with row scales (p = 2) and
    per tile (p < 1)."""
    gen = generator("diff_dk2_split", device, dtype, power, skip)
    b, hq, hkv, tq, tk, d, dv = 1, 4, 2, 29, 45, 24, 40
    (q1, q2, k1, k2, v), beta, lam = make_inputs(gen, device, dtype, b, hq, hkv, tq, tk, d, dv, "per_head", "per_head")
    q1, q2, k1, k2, v, beta, lam = (t.detach() for t in (q1, q2, k1, k2, v, beta, lam))
    dout = randn(gen, b, hq, tq, dv, dtype=dtype, device=device)
    tile, other = BlockConfig(16, 16, skip_zero=skip), BlockConfig(32, 16, skip_zero=skip)

    def grads(dk2_tile, split_maps=False):
        cfgs = KernelConfigs(tile, tile, tile, dk2_tile, split_maps)
        return diff_triton_backward(q1, q2, k1, k2, v, beta, lam, power, 0.7, dout, True, True, cfgs)

    one = grads(None)
    for split_maps in (False, True):
        for name, a, c in zip(GRADS, one, grads(tile, split_maps)):
            assert torch.equal(a, c) or (split_maps and name == "dv"), (split_maps, name)
    wrt = [t.double().requires_grad_() for t in (q1, q2, k1, k2, v, beta, lam)]
    ref_grads = torch.autograd.grad(differential_reference(*wrt, power, 0.7), wrt, dout.double())
    grad_tol = (SUBLINEAR_GRAD_TOLERANCE if power < 1 else TOLERANCE)[dtype]
    for split in (grads(other), grads(other, True)):
        for i, name in enumerate(GRADS):  # dq1, dq2, dk1, dk2, dv, dbeta, dlam: the inputs' order
            floor = rel_err(ref_grads[i].to(split[i].dtype), ref_grads[i])
            assert rel_err(split[i], ref_grads[i]) < grad_tol + floor, name


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype,power", [(torch.float32, 2.0), (torch.float16, 2.0), (torch.bfloat16, 1.5)], ids=str)
def test_tma_loads_match_pointer_loads_and_the_reference(device, dtype, power, monkeypatch):
    """BlockConfig.tma: every kernel (forward, dK/dV in two launches, dQ) reads q1, q2, k1, k2, v and dO through
    TMA descriptors; the output and every gradient match the float64 reference, and on CPU equal the pointer
    loads' bit for bit. GQA, odd lengths, Tq < Tk, Dv != D, head dims below their blocks (zero-filled columns);
    fp16 with row scales. A layout TMA cannot read (rows 40 bytes apart) loads through pointers."""
    used = record_tma(monkeypatch, td)
    gen = generator("diff_tma", device, dtype, power)
    b, hq, hkv, tq, tk, d, dv = 1, 4, 2, 29, 45, 24, 40
    (q1, q2, k1, k2, v), beta, lam = make_inputs(gen, device, dtype, b, hq, hkv, tq, tk, d, dv, "per_head", "per_head")
    q1, q2, k1, k2, v, beta, lam = (t.detach() for t in (q1, q2, k1, k2, v, beta, lam))
    dout = randn(gen, b, hq, tq, dv, dtype=dtype, device=device)

    def run(tma: bool, *inputs):
        tile = BlockConfig(16, 16, tma=tma)
        cfgs = KernelConfigs(tile, tile, replace(tile, block_m=32), tile)  # dK2 in a second launch
        out = diff_triton_forward(*inputs, beta, lam, power, 0.7, cfgs)
        return [out, *diff_triton_backward(*inputs, beta, lam, power, 0.7, dout, True, True, cfgs)]

    inputs = (q1, q2, k1, k2, v)
    pointers = run(False, *inputs)
    assert not any(used)
    tma = run(True, *inputs)
    assert len(used) == 8 and all(used[4:]), "forward, two dK/dV launches and dQ must load through descriptors"
    wrt = [t.double().requires_grad_() for t in (*inputs, beta, lam)]
    ref = differential_reference(*wrt, power, 0.7)
    refs = [ref, *torch.autograd.grad(ref, wrt, dout.double())]
    for name, got, exact in zip(("out",) + GRADS, tma, refs):
        floor = rel_err(exact.to(got.dtype), exact)
        assert rel_err(got, exact) < TOLERANCE[dtype] + floor, name
    if device == "cpu":
        for a, c in zip(pointers, tma):
            assert torch.equal(a, c)

    if dtype != torch.float32:  # rows 40 bytes apart (fp32's, 80, are 16-byte aligned): the pointer loads themselves
        used.clear()
        narrow = [x[..., :20].contiguous() for x in inputs]
        fallback = run(True, *narrow)
        assert not any(used), "rows not 16 bytes apart: pointers"
        assert all(torch.equal(a, c) for a, c in zip(fallback, run(False, *narrow)))


def test_equals_two_single_op_calls():
    """The fused op computes what two threshold_attention calls and a per-head lambda do (float64, torch)."""
    gen = generator("diff_two_calls")
    (q1, q2, k1, k2, v), beta, lam = make_inputs(gen, "cpu", torch.float64, 2, 4, 2, 15, 15, 8, 8, "per_head", "per_head")
    fused = differential_threshold_attention(q1, q2, k1, k2, v, beta, lam, 1.5)
    two = threshold_attention(q1, k1, v, beta, 1.5) - lam[:, None, None] * threshold_attention(q2, k2, v, beta, 1.5)
    torch.testing.assert_close(fused, two, rtol=1e-12, atol=1e-12)


def _op_args(backend: str, dtype=torch.float32, layout="bhtd"):
    gen = generator("diff_library", backend, dtype, layout)
    qkv, beta, lam = make_inputs(gen, "cpu", dtype, 2, 4, 2, 5, 9, 16, 8, "per_head", "per_head", layout)
    return (*qkv, beta, lam, 1.5, 0.5, backend)


@pytest.mark.parametrize("dtype,layout", [(torch.float64, "bhtd"), (torch.float32, "bthd"), (torch.float64, "sliced")], ids=str)
def test_opcheck_torch_backend(dtype, layout):
    args = _op_args("torch", dtype, layout)
    torch.library.opcheck(differential_threshold_attention_op, args)
    dout = randn(generator("diff_library_dout", dtype), 2, 4, 5, 8, dtype=dtype)
    inputs = tuple(a.detach() for a in args[:7])
    for need in ((True, True), (False, False)):
        torch.library.opcheck(differential_threshold_attention_backward_op, (dout, *inputs, *args[7:], *need))


def test_opcheck_torch_backend_empty_batch():
    q1, q2, k1, k2, v, beta, lam, *rest = _op_args("torch")
    torch.library.opcheck(differential_threshold_attention_op, (q1[:0], q2[:0], k1[:0], k2[:0], v[:0], beta, lam, *rest))


def test_opcheck_triton_backend():
    """Under TRITON_INTERPRET=1 on CPU (tests/conftest.py), else on CUDA tensors."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = generator("diff_library_triton")
    qkv, beta, lam = make_inputs(gen, device, torch.float32, 1, 2, 1, 3, 4, 16, 16, "per_head", "per_head")
    torch.library.opcheck(differential_threshold_attention_op, (*qkv, beta, lam, 2.0, 1.0, "triton"))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "q2": a["q2"].numpy()}, TypeError, "q2"),
        (lambda a: {**a, "q2": a["q2"][:, :, :-1]}, ValueError, "q2"),
        (lambda a: {**a, "k2": a["k2"].double()}, TypeError, "k2"),
        (lambda a: {**a, "k1": "k"}, TypeError, "k1"),
        (lambda a: {**a, "lam": torch.ones(3)}, ValueError, "lam"),
        (lambda a: {**a, "lam": "0.5"}, TypeError, "lam"),
        (lambda a: {**a, "beta": torch.ones(2, 2)}, ValueError, "beta"),
        (lambda a: {**a, "power": -1.0}, ValueError, "power"),
        # the checks shared with the single op name the differential op's own arguments
        (lambda a: {**a, "q1": a["q1"].int(), "q2": a["q2"].int()}, TypeError, r"^q1 must be float16"),
        (lambda a: {**a, **{n: a[n].repeat(1, 3, 1, 1) for n in ("k1", "k2", "v")}}, ValueError, r"^q1's heads"),
        (lambda a: {**a, "v": a["v"][:, :, :3]}, ValueError, r"^k1 and v must have the same sequence length"),
    ],
)
def test_bad_arguments_are_named(change, error, match):
    gen = generator("diff_errors")
    q1, q2, k1, k2, v = (randn(gen, 1, 2, 4, 8) for _ in range(5))
    args = change(dict(q1=q1, q2=q2, k1=k1, k2=k2, v=v, beta=0.5, lam=0.5, power=2.0))
    with pytest.raises(error, match=match):
        differential_threshold_attention(**args)


def test_compat_clamps_lambda_and_refuses_nan():
    gen = generator("diff_compat")
    q1, q2, k1, k2, v = (randn(gen, 1, 2, 6, 8, dtype=torch.float64) for _ in range(5))
    out = differential_threshold_rela_triton(q1, q2, k1, k2, v, 0.1, torch.tensor([1.7, -0.2], dtype=torch.float64))
    n = [F.normalize(t, dim=-1) for t in (q1, q2, k1, k2)]
    clamped = differential_reference(*n, v, 0.1, torch.tensor([1.0, 0.0], dtype=torch.float64), 2.0, 1.0)
    torch.testing.assert_close(out, clamped, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="lambda_param"):
        differential_threshold_rela_triton(q1, q2, k1, k2, v, 0.1, torch.tensor([0.5, math.nan]))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_variant_matches_two_single_op_calls_with_gradients(n_kv_heads):
    """DiffThresholdAttention.attend (one fused call) equals the two-call formula, output and gradients
    (q, k, v, beta and the lambda parameters), with an unclamped lambda."""
    torch.manual_seed(0)
    attn = DiffThresholdAttention(32, 4, 1, n_kv_heads=n_kv_heads, beta=0.2).double()
    with torch.no_grad():
        attn.lambda_q1.fill_(0.5), attn.lambda_k1.fill_(0.5), attn.lambda_q2.fill_(0.1)  # lambda > 1
    gen = generator("diff_variant", n_kv_heads)
    q = randn(gen, 2, 8, 7, 4, dtype=torch.float64).requires_grad_()  # (B, 2H, T, Dq)
    k = randn(gen, 2, 2 * n_kv_heads, 7, 4, dtype=torch.float64).requires_grad_()  # (B, 2Hkv, T, Dq)
    v = randn(gen, 2, n_kv_heads, 7, 8, dtype=torch.float64).requires_grad_()  # (B, Hkv, T, Dh)
    wrt = [q, k, v, attn.threshold.beta, attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2]

    fused = attn.attend(q, k, v)
    (q1, q2), (k1, k2) = (F.normalize(t, dim=-1).chunk(2, dim=1) for t in (q, k))
    beta, lam = attn.threshold.beta, attn.lambda_full()
    assert lam > 1
    y = threshold_attention(q1, k1, v, beta) - lam * threshold_attention(q2, k2, v, beta)
    two = attn.out_norm(y) * (1 - attn.lambda_init)
    torch.testing.assert_close(fused, two, rtol=1e-12, atol=1e-12)
    dout = randn(gen, *fused.shape, dtype=torch.float64)
    for g_fused, g_two in zip(torch.autograd.grad(fused, wrt, dout), torch.autograd.grad(two, wrt, dout)):
        assert g_two.abs().max() > 0
        torch.testing.assert_close(g_fused, g_two, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_propagates_to_the_rows_it_reaches(backend):
    """ReLU(NaN) = NaN: a NaN in q2 makes its own output row NaN and leaves every other row finite."""
    gen = generator("diff_nan", backend)
    q1, q2, k1, k2, v = (randn(gen, 1, 2, 9, 16) for _ in range(5))
    q2[0, 1, 4, 3] = math.nan
    out = differential_threshold_attention(q1, q2, k1, k2, v, 0.1, torch.tensor([0.5, 0.7]), backend=backend)
    nan_rows = out.isnan().any(-1)  # (1, 2, 9)
    assert nan_rows[0, 1, 4] and nan_rows.sum() == 1


def test_fake_tensors_give_shapes_and_dtypes_without_computing():
    with FakeTensorMode():
        q1, q2 = torch.empty(2, 4, 5, 16, dtype=torch.bfloat16), torch.empty(2, 4, 5, 16, dtype=torch.bfloat16)
        k1, k2 = torch.empty(2, 2, 9, 16, dtype=torch.bfloat16), torch.empty(2, 2, 9, 16, dtype=torch.bfloat16)
        v = torch.empty(2, 2, 9, 24, dtype=torch.bfloat16)
        out = differential_threshold_attention(q1, q2, k1, k2, v, torch.zeros(4), 0.5, 1.5, backend="torch")
    assert out.shape == (2, 4, 5, 24) and out.dtype == torch.bfloat16


def test_default_configs_follow_the_interpreter_flag(monkeypatch):
    """default_diff_configs is cached per (head dim, dtype) and per interpreter flag: setting or clearing
    TRITON_INTERPRET changes the tiles (small ones for the interpreter) without a stale cache entry."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gpu = td.default_diff_configs(128, torch.bfloat16)
    assert gpu is td.default_diff_configs(128, torch.bfloat16)  # cached
    assert gpu.fwd.block_m * gpu.fwd.block_n > 32 * 32 and gpu != td.default_diff_configs(64, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert td.default_diff_configs(128, torch.bfloat16) == KernelConfigs(*[BlockConfig(32, 32)] * 3)


def test_large_calls_get_the_tma_tiles_and_smaller_ones_the_pointer_tiles(monkeypatch):
    """default_diff_configs' large-call tiles (v25; some with TMA loads) go to calls of at least twice the single
    op's TMA_MIN_WORK (large_call); smaller calls keep the previous tiles, all through pointers."""
    from lit_thresh.ops import triton_launch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    large, small = td.default_diff_configs(64, torch.float16), td.default_diff_configs(64, torch.float16, large=False)
    kernels = ("fwd", "bwd_dkv", "bwd_dq")
    assert all(getattr(large, k).tma for k in kernels) and not any(getattr(small, k).tma for k in kernels)
    assert small is td.default_diff_configs(64, torch.float16, large=False)  # cached
    side = math.isqrt(2 * triton_launch.TMA_MIN_WORK // (16 * 128) - 1) + 1  # (1, 16, side, 128): the least length
    for t, expected in ((side, True), (side - 1, False)):
        q = torch.empty(1, 16, t, 128, device="meta")
        assert td.large_call(q, q, q) == expected
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tile = BlockConfig(16, 16)
    monkeypatch.setattr(td, "_default_diff_configs", lambda d, dtype, interpreting, large: KernelConfigs(
        *[replace(tile, tma=large)] * 4))
    used = record_tma(monkeypatch, td)  # these inputs suit TMA: it is used wherever a config asks for it
    gen = generator("diff_large_call")
    x = [randn(gen, 1, 2, 20, 16, dtype=torch.float16) for _ in range(6)]
    beta, lam = torch.tensor([0.5, 1.0]), torch.tensor([0.3, 0.6])
    for min_work, large_tiles in ((triton_launch.TMA_MIN_WORK, False), (0, True)):
        monkeypatch.setattr(triton_launch, "TMA_MIN_WORK", min_work)
        used.clear()
        diff_triton_forward(*x[:5], beta, lam, 2.0, 1.0)
        diff_triton_backward(*x[:5], beta, lam, 2.0, 1.0, x[5], True, True)
        assert used == [large_tiles] * 4  # the forward, two dK/dV launches, dQ


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter accepts code the compiler rejects: compile each kernel for sm_90 down to a cubin, in a
    process without TRITON_INTERPRET (no GPU needed), with its default tiles (large calls'; small calls' where
    they differ) at head dims where they are largest (the shared memory must fit an H200's 227 KiB), through
    pointers (the fallback of layouts TMA cannot read) and, for four of the large calls' TMA tiles (D = 128's
    dK/dV in both launches that read one map), through tensor descriptors, with the constexprs the launchers pass.
    fp16:
    every kernel row-scaled (ROW_SCALE) in each power mode, and the backward's per-tile path of p < 1
    (FP16_RANGE). fp64 float scalars as torch.compile passes them. ptxas assembles each launch once per dtype and
    load kind; its other power modes, head dims and tiles stop at PTX (sm90.compile_for_sm90's assemble)."""
    script = textwrap.dedent(
        """
        import torch
        from lit_thresh.ops import triton_differential as td
        from tests.ops.sm90 import compile_for_sm90, descriptor_blocks

        cases = [("diff_threshold_fwd_kernel", "fwd", "fp16", torch.float16, 256, 256, 1.5, False),
                 ("diff_threshold_bwd_dkv_kernel", "bwd_dkv", "bf16", torch.bfloat16, 64, 128, 2.0, True),
                 ("diff_threshold_bwd_dq_kernel", "bwd_dq", "fp32", torch.float32, 200, 72, 1.0, False),
                 ("diff_threshold_fwd_kernel", "fwd", "bf16", torch.bfloat16, 128, 128, 2.0, False),
                 ("diff_threshold_bwd_dq_kernel", "bwd_dq", "fp16", torch.float16, 128, 128, 2.0, False)]
        cases += [("diff_threshold_fwd_kernel", "fwd", "fp16", torch.float16, 128, 128, p, False) for p in (1.0, 2.0, 0.5)]
        cases += [("diff_threshold_bwd_dkv_kernel", "bwd_dkv", "fp16", torch.float16, 128, 128, p, False)
                  for p in (1.0, 2.0, 1.5, 0.5)]
        cases += [("diff_threshold_bwd_dq_kernel", "bwd_dq", "fp16", torch.float16, 128, 128, p, False)
                  for p in (1.0, 1.5, 0.5)]
        cases += [("diff_threshold_bwd_dkv_kernel", "bwd_dk2", "fp16", torch.float16, 128, 128, p, False)
                  for p in (2.0, 0.5)]
        cases += [("diff_threshold_bwd_dkv_kernel", "bwd_dkv", "bf16", torch.bfloat16, 128, 128, 2.0, True),
                  ("diff_threshold_bwd_dkv_kernel", "bwd_dk2", "bf16", torch.bfloat16, 128, 128, 2.0, False)]
        # small calls' tiles where they differ from the large calls': dQ, and D = 128's dK/dV (bf16 in two launches)
        cases += [("diff_threshold_bwd_dq_kernel", "bwd_dq", "fp16", torch.float16, 128, 128, p, False, False)
                  for p in (2.0, 0.5)]
        cases += [("diff_threshold_bwd_dkv_kernel", "bwd_dkv", "fp16", torch.float16, 128, 128, p, False, False)
                  for p in (2.0, 0.5)]
        cases += [("diff_threshold_bwd_dkv_kernel", which, "bf16", torch.bfloat16, 128, 128, 2.0, False, False)
                  for which in ("bwd_dkv", "bwd_dk2")]

        assembled = set()  # (launch, dtype, loads) already taken down to a cubin by ptxas

        def compile_case(name, which, dtype, torch_dtype, d, dv, power, skip, large=True, tma=False):
            kind = (which, dtype, tma)
            cfgs = td.default_diff_configs(max(d, dv), torch_dtype, large)
            cfg = getattr(cfgs, which)
            flags = (("BETA_GRAD", True), ("LAM_GRAD", True)) if which == "bwd_dq" else ()
            if which.startswith("bwd_dk"):  # the PART diff_triton_backward launches
                first, second = (3, 4) if cfgs.split_maps else (1, 2)
                flags = (("PART", 0 if cfgs.bwd_dk2 is None else second if which == "bwd_dk2" else first),)
            descriptors = None
            if tma:  # the inputs as descriptors of the blocks the launchers make
                assert cfg.tma, (name, dtype, d)
                descriptors = descriptor_blocks(getattr(td, name), cfg.block_m, cfg.block_n, td._block_dim(d),
                                                td._block_dim(dv))
            flags += (("USE_TMA", tma),)
            meta = td._meta(td.BlockConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, skip), d, dv, power,
                            torch_dtype, "tf32" if dtype == "fp32" else "ieee", False, which == "fwd", flags)
            assemble = kind not in assembled
            compiled = compile_for_sm90(getattr(td, name), meta, dtype, descriptors=descriptors, assemble=assemble,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            assembled.add(kind)
            assert bool(compiled.asm["cubin"]) == assemble, (name, power, assemble)
            assert compiled.metadata.shared <= 227 * 1024, (name, power, compiled.metadata.shared)

        for case in cases:  # pointer loads
            compile_case(*case)
        # the large calls' tiles that load through TMA, with descriptors
        compile_case("diff_threshold_fwd_kernel", "fwd", "fp16", torch.float16, 64, 64, 2.0, False, tma=True)
        compile_case("diff_threshold_bwd_dkv_kernel", "bwd_dkv", "bf16", torch.bfloat16, 64, 64, 2.0, False, tma=True)
        compile_case("diff_threshold_bwd_dq_kernel", "bwd_dq", "fp16", torch.float16, 128, 128, 2.0, False, tma=True)
        for which in ("bwd_dkv", "bwd_dk2"):  # D = 128's two dK/dV launches that read one map each
            compile_case("diff_threshold_bwd_dkv_kernel", which, "bf16", torch.bfloat16, 128, 128, 2.0, False, tma=True)
            compile_case("diff_threshold_bwd_dkv_kernel", which, "fp16", torch.float16, 128, 128, 2.0, False, tma=True)
        print("compiled")
        """
    )
    run_without_interpreter(script, tmp_path, timeout=600)
