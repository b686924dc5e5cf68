"""tests/interpreter_patches.py: the Triton interpreter names it replaces are still there and used as it expects, and
kernels give the same results with its patches."""

import types

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from lit_thresh.ops.backend import triton_interpreting
from tests import interpreter_patches

interpreting = pytest.mark.skipif(not triton_interpreting(), reason="the patches apply to the interpreter")


@triton.jit
def _scaled_relu(x, scale):
    return tl.maximum(x * scale, 0.0)


@triton.jit
def _relu_rows_kernel(X, OUT, scale, N: tl.constexpr):
    """OUT[row] = relu(X[row] * scale) through two helper calls, and a tl.sum (a jit function of Triton's)."""
    row = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(X + row * N + offs)  # (N,)
    y = _scaled_relu(x, scale)
    y = _scaled_relu(y, 1.0) + 0.0 * tl.sum(y, axis=0)
    tl.store(OUT + row * N + offs, y)


def test_the_interpreter_still_calls_the_functions_the_patches_replace():
    assert isinstance(interpreter._LangPatchScope(), interpreter._LangPatchScope)
    # looked up by name at each call, so that replacing the module attribute reaches them
    assert "_patch_lang" in interpreter.GridExecutor.__call__.__code__.co_names
    assert "_patch_lang" in interpreter.InterpretedFunction.__call__.__code__.co_names
    uses_np_dtype = [f for f in vars(interpreter.InterpreterBuilder).values()
                     if isinstance(f, types.FunctionType) and "_get_np_dtype" in f.__code__.co_names]
    assert len(uses_np_dtype) >= 5
    for dtype in (tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int1, tl.int8, tl.int32, tl.int64, tl.uint64):
        block = tl.block_type(dtype, [4, 8])
        assert interpreter_patches._np_dtype(dtype) == interpreter_patches.ORIGINAL_NP_DTYPE(dtype)
        assert interpreter_patches._np_dtype(block) == interpreter_patches.ORIGINAL_NP_DTYPE(block)
    pointer = tl.pointer_type(tl.float32)
    assert interpreter_patches._np_dtype(pointer) == interpreter_patches.ORIGINAL_NP_DTYPE(pointer)
    pointers = tl.block_type(pointer, [16])
    assert interpreter_patches._np_dtype(pointers) == interpreter_patches.ORIGINAL_NP_DTYPE(pointers)


@interpreting
def test_helper_calls_skip_the_repeat_patch_and_the_kernel_restores_the_language(monkeypatch):
    assert interpreter._patch_lang is interpreter_patches._patch_lang  # installed by tests/conftest.py
    assert interpreter._get_np_dtype is interpreter_patches._np_dtype
    patched, original = [], interpreter_patches.ORIGINAL_PATCH_LANG

    def counting(fn):
        patched.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter_patches, "ORIGINAL_PATCH_LANG", counting)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    for _ in range(2):
        _relu_rows_kernel[(3,)](x, out, 1.5, N=16)
        torch.testing.assert_close(out, torch.relu(x * 1.5), rtol=0, atol=0)
        assert tl.core.is_builtin(tl.dot) and tl.core.is_builtin(tl.tensor.__add__)  # restored on return
    # per launch: the kernel's patch, and tl.sum's (Triton's standard library sees tl.core, left unpatched by the
    # kernel) on its first call only; the helper calls of the 3 programs (6) patch nothing
    assert patched.count("_relu_rows_kernel") == 2 and "_scaled_relu" not in patched, patched
