"""Triton's interpreter (TRITON_INTERPRET=1) without two of its repeated costs, for the tests on CPU; same results.

- The interpreter rebinds triton.language to its numpy implementation when a kernel starts, and restores it when the
  kernel returns. It rebinds it again at every call of a @triton.jit helper inside the kernel
  (InterpretedFunction.__call__ -> _patch_lang), where it is already rebound: builtins already replaced are no longer
  builtins, so `_patch_builtin` skips them, and the rest sets equivalent functions again. Each repeat scans
  triton.language, its tensor class and tl.math with inspect.getmembers: 9.4 of the 24.4 s that
  tests/ops/test_skip_tiles.py::test_a_nan_tile_is_not_skipped spent in kernels. Here a call whose language
  modules are all rebound already returns an empty patch scope (nothing to undo).
- `_get_np_dtype` builds a table of 19 dtypes at each call (5.2 of the 37 s of one of test_skip_tiles.py's larger
  tests). Here each element type's answer is kept.

This file is the only place the tests use Triton's private interpreter names; tests/test_interpreter_patches.py
fails when they move.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

ORIGINAL_PATCH_LANG: Callable = interpreter._patch_lang
ORIGINAL_NP_DTYPE: Callable = interpreter._get_np_dtype


def _rebound(owner: object, name: str) -> bool:
    """Whether the builtin `name` of `owner` is replaced by the interpreter's version."""
    return not tl.core.is_builtin(getattr(owner, name))


def _already_patched(langs: list) -> bool:
    """Whether _patch_lang on a function seeing the language modules `langs` would change nothing: each module's
    builtins (and tl.math's, with tl) and the shared tensor classes' are rebound (one _patch_lang call rebinds them
    all, and a kernel's return restores them all)."""
    return (
        bool(langs)
        and all(_rebound(lang, "dot") for lang in langs)
        and (tl not in langs or _rebound(tl.math, "exp"))
        and _rebound(tl.tensor, "__add__")
        and _rebound(tl.core.tensor_descriptor_base, "load")
    )


def _patch_lang(fn: Callable) -> interpreter._LangPatchScope:
    """interpreter._patch_lang, skipped where it would change nothing."""
    langs = _LANGS.get(fn)
    if langs is None:  # the scan _patch_lang does, once per function
        langs = _LANGS[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
    if _already_patched(langs):
        return interpreter._LangPatchScope()
    return ORIGINAL_PATCH_LANG(fn)


_LANGS: dict[Callable, list] = {}


def _np_dtype(tt_dtype: tl.dtype) -> np.dtype:
    """interpreter._get_np_dtype, kept per element type (a block's numpy dtype is its element type's)."""
    scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
    if isinstance(scalar, tl.pointer_type):  # not hashable; the original answers these at its first line
        return ORIGINAL_NP_DTYPE(scalar)
    try:
        return _NP_DTYPES[scalar]
    except KeyError:
        found = _NP_DTYPES[scalar] = ORIGINAL_NP_DTYPE(tt_dtype)
        return found


_NP_DTYPES: dict[tl.dtype, np.dtype] = {}


def install() -> None:
    """Routes the interpreter's language patches (kernel starts and helper calls) through _patch_lang, and its numpy
    dtypes through _np_dtype."""
    interpreter._patch_lang = _patch_lang
    interpreter._get_np_dtype = _np_dtype
