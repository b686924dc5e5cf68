"""Kernels compiled for sm_90 without a GPU (Triton's ASTSource down to a cubin, or to PTX only), with the argument
types a launch gives them. The compile tests call compile_for_sm90 in a process without TRITON_INTERPRET
(run_without_interpreter); results/fp16_forward_sass.py disassembles what it returns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[2]  # the repository: `tests` importable from a script run anywhere
POINTER_TYPES = {  # the kernels' pointer arguments that are not inputs or outputs of the input dtype
    "BETA": "*fp32", "GAINS": "*fp32", "LAM": "*fp32", "DBETA_ROWS": "*fp32", "DLAM_ROWS": "*fp32",
    "ROW_NORMS": "*fp32", "MARGIN": "*fp32", "LIVE": "*i8", "LUT": "*i32", "COUNTS": "*i32",
}


def stop_at_ptx(backend=None, stages=None, options=None, language=None, capability=None):
    """A knobs.runtime.add_stages_inspection_hook that leaves ptxas out: the cubin stage returns no bytes. Triton
    calls it without arguments for its part of the cache key, then with the backend's stages."""
    if stages is None:
        return "stop_at_ptx", "stop_at_ptx"
    stages["cubin"] = lambda src, metadata: b""


def compile_for_sm90(kernel, constexprs: dict, element_type: str, float_type: str = "fp64", specialise: bool = False,
                     descriptors: dict[str, tuple[int, ...]] | None = None, assemble: bool = True, **options):
    """kernel (a triton.jit function) compiled for sm_90. Its arguments: the constexprs it takes from
    `constexprs`; pointers (every argument before the first stride_) typed by POINTER_TYPES, else pointers to
    element_type ("bf16", "fp16", "fp32"); scale and power float_type ("fp64": torch.compile passes Python floats
    so); other ints i32. specialise: as a launch on 16-byte-aligned tensors with unit last strides specialises
    them (pointers and the other strides divisible by 16, each last stride the constexpr 1). descriptors: the
    inputs passed as TMA tensor descriptors (USE_TMA), by argument name, with their block shapes (1, 1, rows,
    cols), as triton_launch._sources makes them. assemble: False stops at PTX (no ptxas, about 40% of a large
    kernel's compile time; the result then holds no cubin). options: Triton's compile options (num_warps,
    num_stages)."""
    consts = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    n_ptr = next(i for i, arg in enumerate(kernel.arg_names) if arg.startswith("stride_"))
    sig, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
        elif specialise and arg.startswith("stride_") and arg.endswith("d"):  # a last stride (stride_qd, ...)
            sig[arg], consts[arg] = "constexpr", 1
        elif arg in (descriptors or {}):
            sig[arg] = f"tensordesc<{element_type}[{','.join(map(str, descriptors[arg]))}]>"
        elif i < n_ptr:
            sig[arg] = POINTER_TYPES.get(arg, f"*{element_type}")
            if specialise:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[arg] = float_type if arg in ("scale", "power") else "i32"
            if specialise and arg.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    hook, cache = knobs.runtime.add_stages_inspection_hook, knobs.cache.dir
    if not assemble:  # Triton 3.6 leaves the hook out of its cache key: PTX-only kernels get a cache of their own
        knobs.runtime.add_stages_inspection_hook, knobs.cache.dir = stop_at_ptx, os.path.join(cache, "ptx_only")
    try:
        return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    finally:
        knobs.runtime.add_stages_inspection_hook, knobs.cache.dir = hook, cache


def descriptor_blocks(kernel, block_m: int, block_n: int, block_d: int, block_dv: int) -> dict[str, tuple[int, ...]]:
    """compile_for_sm90's descriptors for a kernel whose inputs load through TMA: the blocks (1, 1, rows, cols) the
    launchers' triton_launch._sources calls make, BLOCK_M rows of queries and dO, BLOCK_N of keys and values;
    BLOCK_DV columns of V and dO, BLOCK_D of the others."""
    rows = dict(Q=block_m, Q1=block_m, Q2=block_m, dO=block_m, K=block_n, K1=block_n, K2=block_n, V=block_n)
    return {arg: (1, 1, r, block_dv if arg in ("V", "dO") else block_d) for arg, r in rows.items()
            if arg in kernel.arg_names}


def run_without_interpreter(script: str, cache_dir: Path, timeout: int) -> None:
    """Runs a Python script in a new process without TRITON_INTERPRET (Triton compiles for real), with its own
    Triton cache and this repository importable; it must exit cleanly and print "compiled"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def sass_loops(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]], list[tuple[int, int]]]:
    """A `cuobjdump -sass` listing's instructions [(address, line)], its loops [(first, last address)] (the
    backward branches) and those loops that hold HGMMAs (the key loops; an outer loop holds its inner ones')."""
    instrs = [(int(m.group(1), 16), line) for line in text.splitlines()
              if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", line))]
    loops = [(int(m.group(1), 16), addr) for addr, line in instrs
             if (m := re.search(r"BRA (0x[0-9a-f]+)", line)) and int(m.group(1), 16) < addr]
    mma = [addr for addr, line in instrs if "HGMMA" in line]
    return instrs, loops, [(s, e) for s, e in loops if any(s <= a <= e for a in mma)]
