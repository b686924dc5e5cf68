"""FastLaunch (lit_thresh/ops/fast_launch.py): one Triton launch through `kernel[grid]` per distinct
specialisation, then the compiled kernel directly. The Triton internals it relies on are checked here, so
that a Triton upgrade that moves them fails a test instead of a launch."""

from __future__ import annotations

import inspect

import pytest
import torch
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from lit_thresh.ops import fast_launch
from lit_thresh.ops.fast_launch import FastLaunch
from lit_thresh.ops.triton_differential import diff_threshold_bwd_dq_kernel
from lit_thresh.ops.triton_kernels import threshold_fwd_kernel
from tests.ops.helpers import TOLERANCE, generator, randn, reference_with_grads, rel_err


def test_the_triton_internals_fast_launch_uses_are_where_it_expects_them():
    """JITFunction.run returns the CompiledKernel it launched; CompiledKernel[grid]'s runner does what
    fast_launch.launch does (stream from the driver, launch metadata, then run with the hooks and every
    argument); a JITFunction's params are its parameters in order, with their defaults."""
    assert "return kernel" in inspect.getsource(JITFunction.run)
    runner_src = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    assert "def runner(*args, stream=None)" in runner_src
    assert "stream = driver.active.get_current_stream(device)" in runner_src
    assert "launch_metadata = self.launch_metadata(grid, stream, *args)" in runner_src
    assert ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)") in runner_src
    for kernel in (threshold_fwd_kernel, diff_threshold_bwd_dq_kernel):
        signature = inspect.signature(kernel.fn)
        params = JITFunction(kernel.fn).params  # as on a GPU (under the interpreter the kernels are wrapped otherwise)
        assert [p.name for p in params] == list(signature.parameters)
        assert [p.default for p in params] == [v.default for v in signature.parameters.values()]


class _Compiled:
    """Stands in for a CompiledKernel: records the launches made through `run`, as
    (grid, stream, launch metadata, enter hook, exit hook, args)."""

    function, packed_metadata = "function", "packed metadata"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (function, packed_metadata) == (self.function, self.packed_metadata)
        self.launches.append(((gx, gy, gz), stream, launch_metadata, enter_hook, exit_hook, args))


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Kernel:
    """Stands in for a JITFunction with parameters (X, n, scale, BLOCK: constexpr, FLAG: constexpr = False):
    `kernel[grid](...)` records the call, 'compiles' and returns a fresh _Compiled."""

    params = [_Param("X"), _Param("n"), _Param("scale"), _Param("BLOCK"), _Param("FLAG", False)]

    def __init__(self):
        self.calls, self.compiled = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return run


@pytest.fixture
def compiled_mode(monkeypatch):
    """FastLaunch as on a GPU (not interpreting), on CPU tensors."""
    monkeypatch.setattr(fast_launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "current_stream", lambda device: 1000 + device)


def test_the_second_launch_goes_to_the_compiled_kernel_with_every_argument_in_order(compiled_mode):
    kernel, x = _Kernel(), torch.arange(8.0)
    launch, meta = FastLaunch(kernel), {"BLOCK": 32, "num_warps": 4}
    launch((3, 2), (x,), (7, 0.5), meta)
    assert kernel.calls == [((3, 2), (x, 7, 0.5), {"BLOCK": 32, "num_warps": 4})]
    launch((5, 2), (x,), (7, 0.5), meta)
    launch((5, 2), (x,), (7, 0.5), meta, FLAG=True)  # another constexpr: Triton's path again
    assert len(kernel.calls) == 2 and kernel.calls[1][2] == {"BLOCK": 32, "num_warps": 4, "FLAG": True}
    # the runtime arguments, then the constexprs in parameter order (FLAG from its default), grid padded to 3-D
    assert [launch[-1] for launch in kernel.compiled[0].launches] == [(x, 7, 0.5, 32, False)]
    assert kernel.compiled[0].launches[0][0] == (5, 2, 1)
    launch((1,), (x,), (7, 0.5), meta, FLAG=True)
    assert [(launch[0], launch[-1]) for launch in kernel.compiled[1].launches] == [((1, 1, 1), (x, 7, 0.5, 32, True))]


def test_a_direct_launch_gets_the_current_stream_its_metadata_and_tritons_launch_hooks(compiled_mode, monkeypatch):
    """What Triton's runner passes to CompiledKernel.run: the current device's stream, the launch metadata
    for that grid and stream, and the launch hooks in force at the call (a profiler sets them)."""
    kernel, x = _Kernel(), torch.arange(8.0)
    launch, meta = FastLaunch(kernel), {"BLOCK": 32}
    launch((3,), (x,), (7, 0.5), meta)
    enter, leave = object(), object()
    monkeypatch.setattr(fast_launch.knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(fast_launch.knobs.runtime, "launch_exit_hook", leave)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    launch((3,), (x,), (7, 0.5), meta)  # device 2: another key, Triton's path
    launch((3,), (x,), (7, 0.5), meta)
    assert kernel.compiled[1].launches == [
        ((3, 1, 1), 1002, ("metadata", (3, 1, 1), 1002), enter, leave, (x, 7, 0.5, 32, False))]


def test_empty_hook_chains_are_passed_as_none_and_a_hook_added_to_one_is_passed(compiled_mode, monkeypatch):
    """An empty HookChain (no profiler) is passed as None, and with both empty there is no launch metadata:
    the launcher then skips both calls. Once a hook is added to a chain, it and the metadata are passed."""
    kernel, x = _Kernel(), torch.arange(8.0)
    launch, meta = FastLaunch(kernel), {"BLOCK": 32}
    enter, leave = fast_launch.HookChain(), fast_launch.HookChain(reversed=True)
    monkeypatch.setattr(fast_launch.knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(fast_launch.knobs.runtime, "launch_exit_hook", leave)
    launch((3,), (x,), (7, 0.5), meta)
    launch((3,), (x,), (7, 0.5), meta)
    leave.add(print)
    launch((3,), (x,), (7, 0.5), meta)
    (_, _, meta0, enter0, leave0, _), (_, _, meta1, enter1, leave1, _) = kernel.compiled[0].launches
    assert (meta0, enter0, leave0) == (None, None, None)
    assert (meta1, enter1, leave1) == (("metadata", (3, 1, 1), 1000), None, leave)


def test_what_triton_specialises_on_gets_its_own_compiled_kernel(compiled_mode):
    """A new int value, a number of another type, a misaligned or other-dtype tensor, another constexpr
    mapping: each takes Triton's path (which compiles what it must); the same values find their kernel."""
    kernel, x = _Kernel(), torch.arange(16.0)
    launch, meta = FastLaunch(kernel), {"BLOCK": 32}
    cases = [((x,), (7, 0.5)), ((x,), (16, 0.5)), ((x,), (1, 0.5)), ((x,), (1.0, 0.5)), ((x[1:],), (7, 0.5)),
             ((x.double(),), (7, 0.5))]
    for tensors, scalars in cases:
        launch((1,), tensors, scalars, meta)
    launch((1,), (x,), (7, 0.5), {"BLOCK": 32})  # equal, but another object: not assumed the same
    assert len(kernel.calls) == len(cases) + 1
    for tensors, scalars in cases:
        launch((1,), tensors, scalars, meta)
    assert len(kernel.calls) == len(cases) + 1
    assert [len(c.launches) for c in kernel.compiled] == [1] * len(cases) + [0]


def test_the_entries_are_bounded(compiled_mode, monkeypatch):
    monkeypatch.setattr(fast_launch, "MAX_ENTRIES", 3)
    kernel, x = _Kernel(), torch.arange(4.0)
    launch, meta = FastLaunch(kernel), {"BLOCK": 32}
    for n in range(10):  # lengths that change at every call, as in decoding
        launch((1,), (x,), (n + 2, 0.5), meta)
    assert len(launch.entries) <= 3 and len(kernel.calls) == 10


def test_a_kernel_with_pre_run_hooks_always_takes_tritons_path(compiled_mode):
    kernel, x = _Kernel(), torch.arange(8.0)
    kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    launch, meta = FastLaunch(kernel), {"BLOCK": 32}
    for _ in range(3):
        launch((1,), (x,), (7, 0.5), meta)
    assert len(kernel.calls) == 3 and not any(c.launches for c in kernel.compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_launches_after_the_first_match_the_reference_when_alignment_changes(dtype):
    """The same op called on 16-byte-aligned inputs, then on views one element off (Triton compiles a kernel
    without the alignment assumption), then aligned again (the first kernel, from FastLaunch's entries):
    every output and gradient matches the float64 reference."""
    from lit_thresh.ops import threshold_attention, triton_launch

    gen = generator("fast-launch", dtype)
    base = [randn(gen, 2 * 128 * 64 + 1, dtype=dtype, device="cuda") for _ in range(4)]
    beta = torch.tensor([0.5, 1.0], device="cuda", requires_grad=True)
    for offset in (0, 1, 0, 1):
        q, k, v, dout = (t[offset:offset + 2 * 128 * 64].view(1, 2, 128, 64) for t in base)  # (B, H, T, D)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        beta.grad = None
        out = threshold_attention(q, k, v, beta, 2.0, backend="triton")
        out.backward(dout)
        ref, grads = reference_with_grads(q, k, v, beta, 2.0, 1.0, dout)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        for got, want in zip((q.grad, k.grad, v.grad, beta.grad), grads):
            assert rel_err(got, want) < TOLERANCE[dtype]
    assert len(triton_launch._FWD.entries) >= 2  # one per alignment (at least)


@pytest.mark.gpu
def test_a_launch_hook_sees_the_launches_that_skip_tritons_path():
    """Launches through FastLaunch's kept kernels still reach Triton's launch_enter_hook (what profilers
    such as Proton set), with the kernel's name in the launch metadata."""
    import triton

    from lit_thresh.ops import threshold_attention, triton_launch

    gen = generator("fast-launch-hook", torch.bfloat16)
    q, k, v = (randn(gen, 1, 2, 128, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))  # (B, H, T, D)
    beta = torch.tensor([0.5, 1.0], device="cuda")
    threshold_attention(q, k, v, beta, 2.0, backend="triton")  # the first call compiles and keeps the kernel
    entries = len(triton_launch._FWD.entries)
    names = []

    def hook(metadata) -> None:
        names.append(metadata.get()["name"])

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = threshold_attention(q, k, v, beta, 2.0, backend="triton")
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(triton_launch._FWD.entries) == entries  # no new key: the kept kernel was launched
    assert "threshold_fwd_kernel" in names
    assert torch.isfinite(out).all()
