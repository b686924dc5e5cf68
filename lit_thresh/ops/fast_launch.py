"""Kernel launches that skip Triton's per-call argument binding once a kernel is compiled.

`kernel[grid](*args, **constexprs)` binds and specialises every argument, builds a cache key from them,
checks the kernel's globals and only then launches. On the H200's host that took about 12 us of the
forward's ~40 us launch (lit_thresh/ops/PERF.md, v8; one loop per row, so within noise). `FastLaunch` takes that path once
per distinct set of what Triton specialises on, keeps the `CompiledKernel` it returns, and launches that
directly afterwards. The key holds every int and float argument by value (with its type) and every
tensor's dtype and 16-byte alignment (what Triton specialises pointers on), so a hit is a call Triton
would have compiled to the same kernel. Lengths that change at every call (decoding) take Triton's path
each time, as without FastLaunch, plus the key. Triton's global switches (`triton.knobs`, e.g. debug or
instrumentation) and a kernel's changed globals are seen at a key's first launch only; a kernel with
pre-run hooks always takes Triton's path.

This file is the only place that relies on Triton internals: `JITFunction.run` returning the
`CompiledKernel`, and the body of `CompiledKernel[grid]`'s runner, which `launch` repeats without building
the runner at every call: the current stream from Triton's driver, the launch metadata, then
`CompiledKernel.run` with the launch hooks (so a profiler's hooks see these launches too) and every argument
(constexprs included, in the kernel's parameter order). An empty `HookChain` (Triton's hooks unless a
profiler adds one) is passed as None, and with both empty so is the metadata: the launcher then skips them.
tests/ops/test_fast_launch.py fails when any of these moves. Under the interpreter every launch takes
Triton's own path.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from lit_thresh.ops.backend import triton_interpreting

MAX_ENTRIES = 256  # compiled-kernel entries kept per kernel; lengths that change every call (decoding) refill it


def current_stream(device: int) -> int:
    """The raw handle of the device's current stream, as Triton's runner takes it."""
    return driver.active.get_current_stream(device)


def _hook(hook: object) -> object:
    """A launch hook as the launcher takes it: None for an empty HookChain (calling one does nothing)."""
    return None if isinstance(hook, HookChain) and not hook.calls else hook


def launch(compiled, grid: tuple[int, int, int], device: int, args: tuple) -> None:
    """Launch a compiled kernel on the device's current stream, as `compiled[grid](*args)` does; where no
    launch hook is set, without building the launch metadata only hooks read."""
    stream = current_stream(device)
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    metadata = None if enter is None and leave is None else compiled.launch_metadata(grid, stream, *args)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *args)


def _tensor_key(arg: torch.Tensor | TensorDescriptor) -> tuple:
    """What Triton's specialisation of a tensor (pointer) or tensor descriptor argument depends on."""
    if isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), arg.padding)
    return arg.dtype, arg.data_ptr() % 16 == 0


def _key(device: int, tensors: tuple, scalars: tuple, constexprs: Mapping, flags: dict) -> tuple:
    """What a compiled kernel is kept under: every scalar by value and type (1 and 1.0 are equal keys, not the
    same Triton type), each tensor's _tensor_key, the constexprs' identity and the flags."""
    return (id(constexprs), tuple(flags.items()), device, tuple(map(type, scalars)), scalars,
            *[_tensor_key(t) for t in tensors])


class FastLaunch:
    """Launches one Triton kernel: `launch(grid, tensors, scalars, constexprs, **flags)` does what
    `kernel[grid](*tensors, *scalars, **constexprs, **flags)` does. tensors: the leading runtime arguments
    (tensors or tensor descriptors); scalars: the ints and floats after them; constexprs:
    a cached mapping of constexprs and launch options (num_warps, num_stages), the same object at every
    call of one configuration (it is keyed by identity and kept alive by its entries); flags: constexprs
    that change between calls."""

    __slots__ = ("kernel", "entries")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.entries: dict = {}  # key -> (CompiledKernel, the trailing arguments, constexprs)

    def __call__(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: Mapping,
                 **flags: object) -> None:
        if triton_interpreting():
            self.kernel[grid](*tensors, *scalars, **constexprs, **flags)
            return
        device = torch.cuda.current_device()
        key = _key(device, tensors, scalars, constexprs, flags)
        entry = self.entries.get(key)
        if entry is None or getattr(self.kernel, "pre_run_hooks", None):  # the hooks run in Triton's path
            compiled = self.kernel[grid](*tensors, *scalars, **constexprs, **flags)
            if compiled is not None:
                if len(self.entries) >= MAX_ENTRIES:
                    self.entries.clear()
                tail = self._tail(len(tensors) + len(scalars), {**constexprs, **flags})
                self.entries[key] = (compiled, tail, constexprs)
            return
        launch(entry[0], (grid + (1, 1))[:3], device, (*tensors, *scalars, *entry[1]))

    def kept(self, tensors: tuple, scalars: tuple, constexprs: Mapping, **flags: object) -> tuple | None:
        """(the CompiledKernel, the trailing arguments) that a call with these arguments on the current device
        launches directly, or None: not launched yet, interpreting, or a kernel with pre-run hooks."""
        if triton_interpreting() or getattr(self.kernel, "pre_run_hooks", None):
            return None
        entry = self.entries.get(_key(torch.cuda.current_device(), tensors, scalars, constexprs, flags))
        return None if entry is None else entry[:2]

    def _tail(self, n_args: int, named: Mapping) -> tuple:
        """The values of the kernel's parameters after the first n_args: named ones, else their defaults."""
        return tuple(named[p.name] if p.name in named else p.default for p in self.kernel.params[n_args:])
