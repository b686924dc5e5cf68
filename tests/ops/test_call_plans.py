"""Call plans (lit_thresh/ops/call_plans.py): eager calls that repeat a signature skip the checks they passed,
and on CUDA their forward launches the prepared kernel (triton_launch.PreparedForward, and the differential op's
triton_differential.PreparedDiffForward)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from triton.runtime.jit import JITFunction

from lit_thresh.ops import (
    api, call_plans, chunked, chunked_differential, differential_threshold_attention, fast_launch, threshold_attention,
    triton_differential, triton_launch,
)
from lit_thresh.ops.triton_kernels import threshold_fwd_kernel
from tests.ops.helpers import TOLERANCE, differential_reference, generator, randn, reference_with_grads, rel_err


def _inputs(gen, b=1, hq=2, hkv=2, tq=24, tk=24, d=16, dtype=torch.float32, device="cpu"):
    q = randn(gen, b, hq, tq, d, dtype=dtype, device=device)  # (B, Hq, Tq, D)
    k = randn(gen, b, hkv, tk, d, dtype=dtype, device=device)  # (B, Hkv, Tk, D)
    v = randn(gen, b, hkv, tk, d, dtype=dtype, device=device)  # (B, Hkv, Tk, D)
    return q, k, v


def test_the_signature_tells_apart_everything_the_checks_and_the_launch_read(monkeypatch):
    q, k, v = _inputs(generator("signature"))
    beta = torch.full((2,), 0.5)
    args = (q, k, v, beta, 2.0, 1.0, "auto", False)
    base = call_plans.signature(*args)
    assert base == call_plans.signature(q.clone(), k.clone(), v.clone(), beta.clone(), 2.0, 1.0, "auto", False)
    other_layout = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hq, Tq, D) view of (B, Tq, Hq, D) memory
    misaligned = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # 4 bytes off 16-byte alignment
    variants = [
        (other_layout, k, v, beta, 2.0, 1.0, "auto", False), (misaligned, k, v, beta, 2.0, 1.0, "auto", False),
        (q, k.double(), v, beta, 2.0, 1.0, "auto", False), (q, k, v[..., :8], beta, 2.0, 1.0, "auto", False),
        (q, k, v, beta.double(), 2.0, 1.0, "auto", False), (q, k, v, beta[:1], 2.0, 1.0, "auto", False),
        (q, k, v, 0.5, 2.0, 1.0, "auto", False), (q, k, v, 0.25, 2.0, 1.0, "auto", False),
        (q, k, v, beta, 2, 1.0, "auto", False), (q, k, v, beta, 1.0, 1.0, "auto", False),
        (q, k, v, beta, 2.0, 1, "auto", False), (q, k, v, beta, 2.0, 0.5, "auto", False),
        (q, k, v, beta, 2.0, 1.0, "torch", False), (q, k, v, beta, 2.0, 1.0, "auto", True),
        (q, k, v, beta, 2.0, 1.0, "auto", 1),  # equal to True, but not a bool: the checks refuse it
    ]
    keys = [call_plans.signature(*variant) for variant in variants]
    assert None not in keys and len({base, *keys}) == len(keys) + 1
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")  # fp32 dots in tf32
    assert call_plans.signature(*args) != base
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0" if base[-1][1] else "1")  # the CPU 'auto' backend changes with it
    assert call_plans.signature(*args) != base

    class Sub(torch.Tensor):
        pass

    for no_plan in [(q.as_subclass(Sub), k, v, beta), (q, k, v, 1), (q, k, v, True), ("q", k, v, beta)]:
        assert call_plans.signature(*no_plan, 2.0, 1.0, "auto", False) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert call_plans.signature(*args) is None


def test_a_plan_is_kept_the_second_time_a_signature_comes_and_used_from_the_third(monkeypatch):
    checks = []
    check_qkv = api._check_qkv
    monkeypatch.setattr(api, "_check_qkv", lambda *a, **kw: (checks.append(1), check_qkv(*a, **kw))[1])
    q, k, v = _inputs(generator("kept"), dtype=torch.float64)
    beta = torch.tensor([0.5, 1.0], dtype=torch.float64)
    outs = [threshold_attention(q, k, v, beta, 2.0, backend="torch") for _ in range(4)]
    assert len(checks) == 2 and len(call_plans._PLANS) == 1
    plan = next(iter(call_plans._PLANS.values()))
    assert plan.backend == "torch" and plan.forward is None  # a prepared forward only for the Triton kernels on CUDA
    assert all(torch.equal(out, outs[0]) for out in outs)
    threshold_attention(q, k, v.clone(), beta, 2.0, backend="torch")  # another v, the same signature: no checks
    assert len(checks) == 2


def test_a_float_beta_becomes_one_kept_tensor_and_gradients_flow_on_planned_calls():
    gen = generator("planned-grads")
    q, k, v = (t.requires_grad_() for t in _inputs(gen, dtype=torch.float64))
    dout = randn(gen, 1, 2, 24, 16, dtype=torch.float64)
    ref, grads = reference_with_grads(q, k, v, torch.full((2,), 0.5, dtype=torch.float64), 2.0, 1.0, dout)
    for _ in range(4):
        for t in (q, k, v):
            t.grad = None
        out = threshold_attention(q, k, v, 0.5, 2.0, backend="torch")
        out.backward(dout)
        assert rel_err(out, ref) < TOLERANCE[torch.float64]
        for t, want in zip((q, k, v), grads):
            assert rel_err(t.grad, want) < TOLERANCE[torch.float64]
    (plan,) = call_plans._PLANS.values()
    assert plan.beta is not None and plan.beta.shape == (2,) and plan.beta.dtype == torch.float64
    assert torch.equal(plan.beta, torch.full((2,), 0.5, dtype=torch.float64)) and not plan.beta_converted


def test_a_beta_converted_at_each_call_keeps_its_gradient():
    """A 0-d float32 beta with float64 inputs is converted to (Hq,) float64 at every call, planned or not,
    and gets its gradient back in its own shape."""
    gen = generator("converted-beta")
    q, k, v = _inputs(gen, dtype=torch.float64)
    dout = randn(gen, 1, 2, 24, 16, dtype=torch.float64)
    grads = []
    for _ in range(4):
        beta = torch.tensor(0.5, requires_grad=True)
        threshold_attention(q, k, v, beta, 2.0, backend="torch").backward(dout)
        grads.append(beta.grad)
    (plan,) = call_plans._PLANS.values()
    assert plan.beta_converted and plan.beta is None
    assert all(g.shape == () and torch.equal(g, grads[0]) for g in grads)


@pytest.mark.parametrize("skip_zero", [False, True])
def test_planned_calls_launch_the_prepared_forward_with_or_without_a_gradient(monkeypatch, skip_zero):
    """A plan's forward (here a recording stand-in for a PreparedForward) runs the planned calls' forward,
    also those that record a gradient, which then flows as from the launcher's path; not where the backward
    needs skip_zero's tile map."""
    gen = generator("prepared-grad")
    q, k, v = _inputs(gen, dtype=torch.float64)
    beta = torch.tensor([0.5, 1.0], dtype=torch.float64)
    dout = randn(gen, 1, 2, 24, 16, dtype=torch.float64)
    for _ in range(2):
        threshold_attention(q, k, v, beta, skip_zero=skip_zero, backend="torch")
    calls = _record_the_plans_forward(monkeypatch, chunked.chunked_forward)
    with torch.no_grad():
        threshold_attention(q, k, v, beta, skip_zero=skip_zero, backend="torch")
    assert len(calls) == 1
    leaves = [t.detach().requires_grad_() for t in (q, k, v, beta)]
    out = threshold_attention(*leaves, skip_zero=skip_zero, backend="torch")
    assert len(calls) == 1 + (not skip_zero)
    assert skip_zero or all(a is b for a, b in zip(calls[-1], leaves))
    out.backward(dout)
    ref, want = reference_with_grads(q, k, v, beta, 2.0, 1.0, dout)
    assert rel_err(out, ref) < TOLERANCE[torch.float64]
    for leaf, w in zip(leaves, want):
        assert rel_err(leaf.grad, w) < TOLERANCE[torch.float64]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(skip_zero=1), TypeError, "skip_zero must be a bool"),
        (dict(power=float("nan")), ValueError, "power must be a finite float > 0"),
        (dict(beta=torch.ones(3)), ValueError, "beta must be a float, a 0-d tensor or a \\(2,\\) tensor"),
        (dict(k="k"), TypeError, "k must be a torch.Tensor"),
        (dict(v=torch.ones(1, 2, 23, 16)), ValueError, "k and v must have the same sequence length"),
        (dict(backend="cuda"), ValueError, "backend must be 'auto', 'triton' or 'torch'"),
    ],
)
def test_bad_arguments_still_raise_once_a_plan_is_kept(change, error, message):
    q, k, v = _inputs(generator("still-raise"))
    good = dict(q=q, k=k, v=v, beta=torch.ones(2), power=2.0, skip_zero=True, backend="torch")
    for _ in range(3):
        threshold_attention(**good)
    assert any(call_plans._PLANS.values())
    with pytest.raises(error, match=message):
        threshold_attention(**{**good, **change})


def test_a_learned_beta_parameter_is_planned_and_gets_its_gradient():
    """A model's learned beta is an nn.Parameter (a tensor subclass): its calls are planned as a plain tensor's,
    and the planned calls' gradients match the reference."""
    gen = generator("parameter-beta")
    q, k, v = _inputs(gen, dtype=torch.float64)
    beta = torch.nn.Parameter(torch.tensor([0.5, 1.0], dtype=torch.float64))
    dout = randn(gen, 1, 2, 24, 16, dtype=torch.float64)
    ref, want = reference_with_grads(q, k, v, beta, 2.0, 1.0, dout)
    for _ in range(4):
        beta.grad = None
        out = threshold_attention(q, k, v, beta, backend="torch")
        out.backward(dout)
        assert rel_err(out, ref) < TOLERANCE[torch.float64]
        assert rel_err(beta.grad, want[3]) < TOLERANCE[torch.float64]
    assert call_plans.plan_for(call_plans.signature(q, k, v, beta, 2.0, 1.0, "torch", False)) is not None


def test_a_plan_kept_under_inference_mode_serves_only_inference_mode():
    """Lightning's sanity check runs under inference mode before training: a float beta's tensor kept there is
    an inference tensor, which autograd cannot save, so calls outside inference mode have plans of their own."""
    gen = generator("inference-then-grad")
    q, k, v = (t.requires_grad_() for t in _inputs(gen, dtype=torch.float64))
    with torch.inference_mode():
        for _ in range(3):
            threshold_attention(q, k, v, 0.5, backend="torch")
        inference_key = call_plans.signature(q, k, v, 0.5, 2.0, 1.0, "torch", False)
    assert call_plans.signature(q, k, v, 0.5, 2.0, 1.0, "torch", False) != inference_key
    dout = randn(gen, 1, 2, 24, 16, dtype=torch.float64)
    ref, want = reference_with_grads(q, k, v, torch.full((2,), 0.5, dtype=torch.float64), 2.0, 1.0, dout)
    for _ in range(3):
        for t in (q, k, v):
            t.grad = None
        out = threshold_attention(q, k, v, 0.5, backend="torch")
        out.backward(dout)
        assert rel_err(out, ref) < TOLERANCE[torch.float64]
        assert all(rel_err(t.grad, w) < TOLERANCE[torch.float64] for t, w in zip((q, k, v), want))


def test_calls_under_vmap_are_not_planned():
    """functorch's wrapped tensors have no storage (no data pointer): vmapped calls take the checked path."""
    gen = generator("vmap")
    q, k, v = _inputs(gen, dtype=torch.float64)
    qs = torch.stack([q, 0.5 * q, -q])  # (N, B, Hq, Tq, D)
    for _ in range(3):
        got = torch.func.vmap(lambda x: threshold_attention(x, k, v, 0.5, backend="torch"))(qs)
    want = torch.stack([threshold_attention(x, k, v, 0.5, backend="torch") for x in qs])
    assert rel_err(got, want) < TOLERANCE[torch.float64]
    assert len(call_plans._PLANS) == 1  # the loop's calls only


@pytest.mark.parametrize("change, message", [
    (dict(scale=[1.0]), "scale must be a finite float"),
    (dict(power=[2.0]), "power must be a float > 0"),
    (dict(backend=["torch"]), "backend must be 'auto', 'triton' or 'torch'"),
    (dict(skip_zero=[True]), "skip_zero must be a bool"),
])
def test_unhashable_arguments_get_the_checks_message(change, message):
    q, k, v = _inputs(generator("unhashable"))
    with pytest.raises((TypeError, ValueError), match=message):
        threshold_attention(**{**dict(q=q, k=k, v=v, beta=0.5, backend="torch"), **change})


def test_forward_mode_tangents_are_still_refused_once_a_plan_is_kept():
    """A dual tensor has the signature of its primal; the planned call still sees its tangent and refuses it
    (the autograd.Function has no jvp) rather than dropping it."""
    q, k, v = _inputs(generator("tangent"))
    for _ in range(3):
        threshold_attention(q, k, v, 0.5, backend="torch")
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        assert call_plans.plan_for(call_plans.signature(dual, k, v, 0.5, 2.0, 1.0, "torch", False)) is not None
        with pytest.raises(NotImplementedError, match="jvp"):
            threshold_attention(dual, k, v, 0.5, backend="torch")


def test_the_torch_internal_records_nothing_reads_is_where_it_expects_it():
    """function.records_nothing takes unpack_dual's own shortcut: outside any dual level (forward_ad's
    _current_level < 0) no tensor has a tangent."""
    source = " ".join(inspect.getsource(fwAD.unpack_dual).split())
    assert "level = _current_level" in source and "if level < 0: return UnpackedDualTensor(tensor, None)" in source
    assert fwAD._current_level == -1
    with fwAD.dual_level():
        assert fwAD._current_level >= 0


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(call_plans, "MAX_PLANS", 3)
    gen = generator("bounded")
    for t in range(8, 16):  # lengths that change at every call, as in decoding
        q, k, v = _inputs(gen, tq=t, tk=t)
        threshold_attention(q, k, v, 1.0, backend="torch")
    assert len(call_plans._PLANS) <= 3


class _Compiled:
    """Stands in for a CompiledKernel: records each launch's (grid, stream, args)."""

    function, packed_metadata = "function", "packed metadata"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed_metadata, metadata, enter, leave, *args):
        self.launches.append(((gx, gy, gz), stream, args))


class _ForwardKernel:
    """Stands in for a forward kernel (threshold_fwd_kernel unless given): `kernel[grid](...)` returns one
    _Compiled, as a first launch does."""

    def __init__(self, kernel=threshold_fwd_kernel):
        self.params = JITFunction(kernel.fn).params  # as on a GPU
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "gqa, tq < tk"])
def test_the_prepared_forward_launches_what_triton_forward_launches(monkeypatch, layout):
    """On CPU tensors posing as the current CUDA device's: triton_forward's second launch (through FastLaunch's
    kept kernel) and the prepared forward's launch for new tensors of the same signature pass the same grid,
    stream and arguments, tensor for tensor (a new output of the same shape, strides and dtype)."""
    monkeypatch.setattr(fast_launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(fast_launch, "current_stream", lambda device: 1000 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_on_current_cuda_device", lambda q: True)
    monkeypatch.setattr(triton_launch, "_FWD", fast_launch.FastLaunch(_ForwardKernel()))
    gen = generator("prepared", layout)
    shapes = dict(hkv=1, tk=40) if layout.startswith("gqa") else {}
    q, k, v = _inputs(gen, hq=2, dtype=torch.bfloat16, **shapes)
    if layout == "transposed":  # (B, Hq, Tq, D) views of (B, Tq, Hq, D) memory
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    beta = torch.tensor([0.5, 1.0])
    for _ in range(2):
        out, _ = triton_launch.triton_forward(q, k, v, beta, 2.0, 0.5)
    prepared = triton_launch.prepare_forward(q, k, v, beta, 2.0, 0.5)
    assert prepared is not None
    q2, k2, v2, beta2 = (t.clone().as_strided(t.shape, t.stride()) for t in (q, k, v, beta))
    out2 = prepared(q2, k2, v2, beta2)
    assert (out2.shape, out2.stride(), out2.dtype) == (out.shape, out.stride(), out.dtype)
    swap = {id(q): q2, id(k): k2, id(v): v2, id(beta): beta2, id(out): out2}
    _assert_launched_alike(triton_launch._FWD.kernel.compiled.launches, swap)


def _assert_launched_alike(launches: list, swap: dict) -> None:
    """Two recorded launches (grid, stream, args): the same grid, stream and scalars, and in the second each tensor
    of the first replaced by swap[id(tensor)], or the same tensor where swap has none."""
    (grid, stream, args), (grid2, stream2, args2) = launches
    assert (grid2, stream2, len(args2)) == (grid, stream, len(args))
    for a, a2 in zip(args, args2):
        if isinstance(a, torch.Tensor):
            assert swap.get(id(a), a) is a2, "each tensor in its place (the gain table the same one)"
        else:
            assert (type(a2), a2) == (type(a), a)


def test_no_forward_is_prepared_where_triton_forward_does_more_than_one_plain_launch(monkeypatch):
    """fp16 (a row-norm pre-pass), TMA loads and kernels not launched yet get no prepared forward."""
    monkeypatch.setattr(fast_launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_on_current_cuda_device", lambda q: True)
    monkeypatch.setattr(triton_launch, "_FWD", fast_launch.FastLaunch(_ForwardKernel()))
    q, k, v = _inputs(generator("not-prepared"), dtype=torch.bfloat16)
    beta = torch.ones(2)
    assert triton_launch.prepare_forward(q, k, v, beta, 2.0, 1.0) is None  # not launched yet
    assert triton_launch.prepare_forward(*(t.half() for t in (q, k, v)), beta, 2.0, 1.0) is None
    tma = triton_launch.KernelConfigs(*(triton_launch.BlockConfig(32, 32, tma=True),) * 3)
    monkeypatch.setattr(triton_launch, "_default_configs", lambda *args: tma)
    monkeypatch.setattr(triton_launch, "default_tma", lambda q, k, v: True)
    triton_launch._plan.cache_clear()
    try:
        triton_launch.triton_forward(q, k, v, beta, 2.0, 1.0)
        assert triton_launch.prepare_forward(q, k, v, beta, 2.0, 1.0) is None
    finally:
        triton_launch._plan.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "gqa, tq < tk", "misaligned"])
def test_planned_calls_give_the_checked_calls_outputs_and_gradients(dtype, layout):
    """The same inputs called 4 times without gradients (checked, checked, then planned: the prepared forward
    where there is one) and 4 times with: bit-identical outputs and gradients, within the reference's
    tolerance; bf16 and fp32 (but not fp16, whose forward scales rows) get a prepared forward."""
    gen = generator("planned-gpu", dtype, layout)
    shapes = dict(b=2, hq=2, hkv=2, tq=130, tk=130, d=64)
    if layout.startswith("gqa"):
        shapes.update(hkv=1, tk=200)
    q, k, v = _inputs(gen, dtype=dtype, device="cuda", **shapes)
    if layout == "transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if layout == "misaligned":
        q = torch.empty(q.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(q).copy_(q)
    beta = torch.tensor([0.5, 1.0], device="cuda")
    dout = randn(gen, *q.shape[:3], v.shape[3], dtype=dtype, device="cuda")
    with torch.no_grad():
        outs = [threshold_attention(q, k, v, beta, 2.0) for _ in range(4)]
    assert all(torch.equal(out, outs[0]) for out in outs)
    plan = call_plans.plan_for(call_plans.signature(q, k, v, beta, 2.0, 1.0, "auto", False))
    assert plan is not None and (plan.forward is not None) == (dtype != torch.float16)
    ref, want = reference_with_grads(q, k, v, beta, 2.0, 1.0, dout)
    assert rel_err(outs[0], ref) < TOLERANCE[dtype]
    got = []
    for _ in range(4):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, beta)]
        out = threshold_attention(*leaves, 2.0)
        out.backward(dout)
        assert torch.equal(out, outs[0])
        got.append([t.grad for t in leaves])
    for grads in got:
        assert all(torch.equal(g, g0) for g, g0 in zip(grads, got[0]))
    for g, w in zip(got[0], want):
        assert rel_err(g, w) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_a_float_betas_kept_tensor_is_ready_for_calls_on_another_stream():
    """The second call keeps a float beta's (Hq,) tensor, filled on its stream; a third call on another stream
    reads it at once. Here the second call's stream is kept busy, and the block the tensor reuses held NaN."""
    gen = generator("streams")
    q, k, v = _inputs(gen, d=64, dtype=torch.bfloat16, device="cuda")
    busy = torch.randn(4096, 4096, generator=gen).cuda()
    ref = threshold_attention(q, k, v, 0.5)  # the first call of the signature (default stream)
    torch.cuda.synchronize()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        stale = torch.full((2,), float("nan"), device="cuda")
        del stale  # its block goes back to this stream's pool, for the kept tensor
        for _ in range(20):  # tens of ms of queued work before the kept tensor's fill
            busy = busy @ busy / 64
        threshold_attention(q, k, v, 0.5)  # keeps the plan
    with torch.cuda.stream(second):
        out = threshold_attention(q, k, v, 0.5)  # planned
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_no_plan_is_kept_while_a_cuda_graph_is_captured():
    q, k, v = _inputs(generator("captured"), d=64, dtype=torch.bfloat16, device="cuda")
    beta = torch.ones(2, device="cuda")
    for _ in range(3):  # warm-up: compiled kernels, and a plan outside the capture
        threshold_attention(q, k, v, beta, 2.0)
    kept = dict(call_plans._PLANS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            out = threshold_attention(q, k, v, beta, 2.0)
    graph.replay()
    assert call_plans._PLANS == kept
    torch.testing.assert_close(out, threshold_attention(q, k, v, beta, 2.0), rtol=0, atol=0)


def _diff_inputs(gen, dtype=torch.float64, device="cpu"):
    """q1, q2 (1, 2, 24, 16), k1, k2 (1, 1, 24, 16) (GQA), v (1, 1, 24, 8)."""
    q1, q2 = (randn(gen, 1, 2, 24, 16, dtype=dtype, device=device) for _ in range(2))
    k1, k2 = (randn(gen, 1, 1, 24, 16, dtype=dtype, device=device) for _ in range(2))
    return q1, q2, k1, k2, randn(gen, 1, 1, 24, 8, dtype=dtype, device=device)


def _diff_reference_with_grads(tensors, beta, lam, dout, scale=1.0):
    """The differential op's float64 reference output (lam not clamped) and the gradients of q1, q2, k1, k2, v,
    then of beta and lam where they are tensors."""
    group = [t.detach().double().requires_grad_() for t in tensors]
    beta, lam = (x.detach().double().requires_grad_() if isinstance(x, torch.Tensor) else x for x in (beta, lam))
    ref = differential_reference(*group, beta, lam, 2.0, scale)
    wrt = group + [x for x in (beta, lam) if isinstance(x, torch.Tensor)]
    return ref, torch.autograd.grad(ref, wrt, dout.double())


def _record_the_plans_forward(monkeypatch, forward) -> list:
    """The one kept plan's forward replaced by a stand-in that records its inputs and returns
    forward(*inputs, 2.0, 1.0); returns the record."""
    (key,) = call_plans._PLANS
    calls = []

    def recording(*inputs):
        calls.append(inputs)
        return forward(*inputs, 2.0, 1.0)

    monkeypatch.setitem(call_plans._PLANS, key, replace(call_plans._PLANS[key], forward=recording))
    return calls


def test_the_differential_signature_tells_apart_everything_its_checks_read(monkeypatch):
    q1, q2, k1, k2, v = _diff_inputs(generator("diff-signature"), dtype=torch.float32)
    beta, lam = torch.full((2,), 0.5), torch.tensor(0.3)
    tensors = (q1, q2, k1, k2, v)
    base = call_plans.differential_signature(*tensors, beta, lam, 2.0, 1.0, "auto")
    assert base == call_plans.differential_signature(*(t.clone() for t in tensors), beta.clone(), lam.clone(), 2.0,
                                                     1.0, "auto")
    variants = []
    for i, t in enumerate(tensors):  # each tensor in another layout, dtype or shape
        padded = t.new_zeros(*t.shape[:-1], t.shape[-1] + 4)[..., : t.shape[-1]].copy_(t)  # rows 4 elements apart
        for other in (padded, t.double(), t[..., :4]):
            variants.append(tensors[:i] + (other,) + tensors[i + 1:] + (beta, lam, 2.0, 1.0, "auto"))
    variants += [
        (*tensors, beta.double(), lam, 2.0, 1.0, "auto"), (*tensors, 0.5, lam, 2.0, 1.0, "auto"),
        (*tensors, 0.25, lam, 2.0, 1.0, "auto"), (*tensors, beta, lam.reshape(1), 2.0, 1.0, "auto"),
        (*tensors, beta, 0.3, 2.0, 1.0, "auto"), (*tensors, beta, 0.4, 2.0, 1.0, "auto"),
        (*tensors, beta, lam, 2, 1.0, "auto"), (*tensors, beta, lam, 1.0, 1.0, "auto"),
        (*tensors, beta, lam, 2.0, 1, "auto"), (*tensors, beta, lam, 2.0, 0.5, "auto"),
        (*tensors, beta, lam, 2.0, 1.0, "torch"),
    ]
    keys = [call_plans.differential_signature(*variant) for variant in variants]
    assert None not in keys and len({base, *keys}) == len(keys) + 1
    assert call_plans.signature(q1, k1, v, beta, 2.0, 1.0, "auto", False) not in {base, *keys}
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert call_plans.differential_signature(*tensors, beta, lam, 2.0, 1.0, "auto") != base
    monkeypatch.undo()

    class Sub(torch.Tensor):
        pass

    for no_plan in [(q1.as_subclass(Sub), *tensors[1:], beta, lam), (*tensors[:4], "v", beta, lam),
                    (*tensors, 1, lam), (*tensors, beta, True), (*tensors, beta, None)]:
        assert call_plans.differential_signature(*no_plan, 2.0, 1.0, "auto") is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_planned_differential_calls_skip_the_checks_and_keep_every_gradient(monkeypatch, backend):
    """From the third call of a signature the differential op skips its checks; a float beta and lam become kept
    (Hq,) tensors, a 0-d lam requiring grad is converted at each call and gets its gradient in its own shape, and
    outputs and the gradients of q1, q2, k1, k2, v and lam match the float64 reference at every call."""
    checks = []
    check_same = api._check_same
    monkeypatch.setattr(api, "_check_same", lambda *a: (checks.append(1), check_same(*a))[1])
    gen = generator("diff-planned", backend)
    dtype = torch.float64 if backend == "torch" else torch.float32  # the Triton kernels take no float64
    leaves = [t.requires_grad_() for t in _diff_inputs(gen, dtype)]
    dout = randn(gen, 1, 2, 24, 8, dtype=dtype)
    for _ in range(4):
        for t in leaves:
            t.grad = None
        lam = torch.tensor(0.3, dtype=dtype, requires_grad=True)
        out = differential_threshold_attention(*leaves, 0.5, lam, 2.0, scale=0.7, backend=backend)
        out.backward(dout)
        ref, want = _diff_reference_with_grads(leaves, 0.5, lam, dout, 0.7)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        for got, w in zip((*(t.grad for t in leaves), lam.grad), want):
            assert got.shape == w.shape and rel_err(got, w) < TOLERANCE[dtype]
    assert len(checks) == 2 * 2  # two checked calls, each checking the q and k pairs
    (plan,) = call_plans._PLANS.values()
    assert isinstance(plan, call_plans.DifferentialPlan) and plan.backend == backend
    assert torch.equal(plan.beta, torch.full((2,), 0.5, dtype=plan.beta.dtype)) and not plan.beta_converted
    assert plan.lam is None and plan.lam_converted
    with pytest.raises(ValueError, match="q2 must have the shape of q1"):  # another signature: checked again
        differential_threshold_attention(leaves[0], leaves[1][:, :1], *leaves[2:], 0.5, lam, 2.0, backend=backend)


def _pose_as_cuda(monkeypatch) -> None:
    """CPU tensors posing as the current CUDA device's for the differential forward's launches (a fake kernel)."""
    monkeypatch.setattr(fast_launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(fast_launch, "current_stream", lambda device: 1000 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_differential, "_on_current_cuda_device", lambda q: True)
    monkeypatch.setattr(triton_differential, "_FWD",
                        fast_launch.FastLaunch(_ForwardKernel(triton_differential.diff_threshold_fwd_kernel)))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_prepared_differential_forward_launches_what_diff_triton_forward_launches(monkeypatch, layout):
    """As for the single op: diff_triton_forward's second launch and the prepared forward's launch for new
    tensors of the same signature pass the same grid, stream and arguments, tensor for tensor."""
    _pose_as_cuda(monkeypatch)
    q1, q2, k1, k2, v = _diff_inputs(generator("diff-prepared", layout), dtype=torch.bfloat16)  # GQA
    if layout == "transposed":  # (B, H, T, D) views of (B, T, H, D) memory
        q1, q2, k1, k2, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q1, q2, k1, k2, v))
    beta, lam = torch.tensor([0.5, 1.0]), torch.tensor([0.3, 0.2])
    inputs = (q1, q2, k1, k2, v, beta, lam)
    for _ in range(2):
        out = triton_differential.diff_triton_forward(*inputs, 2.0, 0.5)
    prepared = triton_differential.prepare_diff_forward(*inputs, 2.0, 0.5)
    assert prepared is not None
    new = tuple(t.clone().as_strided(t.shape, t.stride()) for t in inputs)
    out2 = prepared(*new)
    assert (out2.shape, out2.stride(), out2.dtype) == (out.shape, out.stride(), out.dtype)
    swap = {id(t): t2 for t, t2 in zip((*inputs, out), (*new, out2))}
    _assert_launched_alike(triton_differential._FWD.kernel.compiled.launches, swap)


def test_no_differential_forward_is_prepared_where_it_would_not_be_one_plain_launch(monkeypatch):
    """Not launched yet, fp16 (a row-norm pre-pass) and a q or k pair whose strides differ (the op copies one)
    get no prepared forward."""
    _pose_as_cuda(monkeypatch)
    q1, q2, k1, k2, v = _diff_inputs(generator("diff-not-prepared"), dtype=torch.bfloat16)
    beta, lam = torch.ones(2), torch.ones(2)
    assert triton_differential.prepare_diff_forward(q1, q2, k1, k2, v, beta, lam, 2.0, 1.0) is None  # not launched
    triton_differential.diff_triton_forward(q1, q2, k1, k2, v, beta, lam, 2.0, 1.0)
    assert triton_differential.prepare_diff_forward(q1, q2, k1, k2, v, beta, lam, 2.0, 1.0) is not None
    halves = [t.half() for t in (q1, q2, k1, k2, v)]
    monkeypatch.setattr(triton_differential, "stacked_row_norms", lambda *t: beta)  # fp16's pre-pass, not run here
    triton_differential.diff_triton_forward(*halves, beta, lam, 2.0, 1.0)
    assert triton_differential.prepare_diff_forward(*halves, beta, lam, 2.0, 1.0) is None
    q2_t = q2.transpose(1, 2).contiguous().transpose(1, 2)  # q1's values in another layout
    k2_t = k2.transpose(2, 3).contiguous().transpose(2, 3)
    assert triton_differential.prepare_diff_forward(q1, q2_t, k1, k2, v, beta, lam, 2.0, 1.0) is None
    assert triton_differential.prepare_diff_forward(q1, q2, k1, k2_t, v, beta, lam, 2.0, 1.0) is None


def test_planned_differential_calls_launch_the_prepared_forward_with_or_without_a_gradient(monkeypatch):
    """A plan's forward (a recording stand-in for a PreparedDiffForward) runs the planned calls' forward, also
    those that record a gradient, which then flows as from the launcher's path."""
    gen = generator("diff-prepared-grad")
    tensors = _diff_inputs(gen)
    beta, lam = torch.tensor([0.5, 1.0], dtype=torch.float64), torch.tensor([0.3, 0.2], dtype=torch.float64)
    dout = randn(gen, 1, 2, 24, 8, dtype=torch.float64)
    for _ in range(2):
        differential_threshold_attention(*tensors, beta, lam, 2.0, backend="torch")
    calls = _record_the_plans_forward(monkeypatch, chunked_differential.chunked_differential_forward)
    with torch.no_grad():
        differential_threshold_attention(*tensors, beta, lam, 2.0, backend="torch")
    assert len(calls) == 1
    leaves = [t.detach().requires_grad_() for t in (*tensors, beta, lam)]
    out = differential_threshold_attention(*leaves, 2.0, backend="torch")
    assert len(calls) == 2 and all(a is b for a, b in zip(calls[-1], leaves))
    out.backward(dout)
    ref, want = _diff_reference_with_grads(leaves[:5], *leaves[5:], dout)
    assert rel_err(out, ref) < TOLERANCE[torch.float64]
    for leaf, w in zip(leaves, want):
        assert rel_err(leaf.grad, w) < TOLERANCE[torch.float64]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "q2 in another layout"])
def test_planned_differential_calls_give_the_checked_calls_outputs_and_gradients(dtype, layout):
    """The differential op called 4 times without gradients (checked, checked, then planned: the prepared forward
    where there is one) and 4 times with: bit-identical outputs and gradients, within the reference's tolerance;
    bf16 and fp32 get a prepared forward, fp16 (rows scaled) and a q pair in two layouts (copied) do not."""
    gen = generator("diff-planned-gpu", dtype, layout)
    q1, q2, k1, k2 = (randn(gen, 2, 4, 130, 64, dtype=dtype, device="cuda") for _ in range(4))
    k1, k2 = k1[:, :2], k2[:, :2]  # GQA
    v = randn(gen, 2, 2, 130, 64, dtype=dtype, device="cuda")
    if layout == "transposed":
        q1, q2, k1, k2, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q1, q2, k1, k2, v))
    elif layout != "contiguous":
        q2 = q2.transpose(1, 2).contiguous().transpose(1, 2)
    beta = torch.linspace(0.25, 1.0, 4, device="cuda")
    dout = randn(gen, 2, 4, 130, 64, dtype=dtype, device="cuda")
    with torch.no_grad():
        outs = [differential_threshold_attention(q1, q2, k1, k2, v, beta, 0.3, 2.0) for _ in range(4)]
    assert all(torch.equal(out, outs[0]) for out in outs)
    plan = call_plans.plan_for(call_plans.differential_signature(q1, q2, k1, k2, v, beta, 0.3, 2.0, 1.0, "auto"))
    assert plan is not None
    assert (plan.forward is not None) == (dtype != torch.float16 and layout != "q2 in another layout")
    got = []
    for _ in range(4):
        leaves = [t.detach().requires_grad_() for t in (q1, q2, k1, k2, v, beta)]
        lam = torch.tensor(0.3, device="cuda", requires_grad=True)
        out = differential_threshold_attention(*leaves, lam, 2.0)
        out.backward(dout)
        assert torch.equal(out, outs[0])
        got.append([t.grad for t in (*leaves, lam)])
    for grads in got:
        assert all(torch.equal(g, g0) for g, g0 in zip(grads, got[0]))
    ref, want = _diff_reference_with_grads((q1, q2, k1, k2, v), beta, torch.tensor(0.3, device="cuda"), dout)
    assert rel_err(outs[0], ref) < TOLERANCE[dtype]
    for g, w in zip(got[0], want):
        assert rel_err(g, w) < TOLERANCE[dtype]
