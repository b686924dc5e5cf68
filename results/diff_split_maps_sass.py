"""The differential op's backward kernels, offline (no GPU: Triton compiles for sm_90, its bundled cuobjdump reports
registers and stack and disassembles). dK/dV: each launch of the default (one launch, or at bf16 D = 128 dK1 and dV,
then dK2) against split_maps' two launches that read one map each (PART 3 and 4, PERF.md v26); dQ: the default's
one launch against bwd_dq2's two (MAP 1 and 2); and the single op's kernels at their default tiles for scale.
D = 128, p = 2, the large calls' tiles; per kernel: registers per thread, stack bytes (spilled registers live
there), the instruction count of each loop's body that holds HGMMAs (nested loops count their inner ones too;
the first two are the innermost key loops) and the spill loads and stores (LDL / STL) inside those loops:

    python results/diff_split_maps_sass.py

It ran on the tree at 4a5cf40 (`git checkout 4a5cf40` to run it again), output in
results/diff_split_maps_sass_2026-12-07.txt. After it, split_maps became D = 128's large-call default and
bwd_dq2 was removed (PERF.md v26), so on later trees it does not run as written.
"""

import os
import re
import subprocess
import sys

import torch
import triton

from lit_thresh.ops import triton_differential as td
from lit_thresh.ops import triton_kernels as tk
from lit_thresh.ops.triton_launch import BlockConfig, _block_dim, default_configs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for tests.ops
from tests.ops.sm90 import compile_for_sm90, descriptor_blocks, sass_loops  # noqa: E402  (the compile tests' helpers)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
D = 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cuobjdump(compiled, flag: str) -> str:
    path = f"/tmp/diff_split_maps_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([os.path.join(BIN, "cuobjdump"), flag, path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.remove(path)


def descriptors(cfg: BlockConfig, kernel) -> dict | None:
    """The inputs as the launchers pass them with TMA (descriptor_blocks), None where cfg loads through pointers."""
    return descriptor_blocks(kernel, cfg.block_m, cfg.block_n, _block_dim(D), _block_dim(D)) if cfg.tma else None


def compile_diff(dtype: str, cfg: BlockConfig, part: int):
    kernel = td.diff_threshold_bwd_dkv_kernel
    meta = td._meta(BlockConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), D, D, 2.0, DTYPES[dtype],
                    "ieee", False, False, (("PART", part), ("USE_TMA", cfg.tma)))
    return compile_for_sm90(kernel, meta, dtype, "fp32", specialise=True, descriptors=descriptors(cfg, kernel),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def compile_diff_dq(dtype: str, cfg: BlockConfig, part: int):
    kernel = td.diff_threshold_bwd_dq_kernel
    meta = td._meta(BlockConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), D, D, 2.0, DTYPES[dtype],
                    "ieee", False, False,
                    (("BETA_GRAD", True), ("LAM_GRAD", True), ("MAP", part), ("USE_TMA", cfg.tma)))
    return compile_for_sm90(kernel, meta, dtype, "fp32", specialise=True, descriptors=descriptors(cfg, kernel),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def compile_single(dtype: str, cfg: BlockConfig, name: str = "threshold_bwd_dkv_kernel"):
    kernel = getattr(tk, name)
    consts = dict(D=D, DV=D, BLOCK_D=D, BLOCK_DV=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, POWER_MODE=2,
                  ROW_SCALE=dtype == "fp16", PRECISION="ieee", UPCAST=False, SKIP_ZERO=False, USE_TMA=cfg.tma,
                  FP16_RANGE=False, BETA_GRAD=True)
    return compile_for_sm90(kernel, consts, dtype, "fp32", specialise=True, descriptors=descriptors(cfg, kernel),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def summary(compiled) -> str:
    usage = cuobjdump(compiled, "-res-usage")
    regs = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    text = cuobjdump(compiled, "-sass")
    instrs, _, key_loops = sass_loops(text)
    bodies = [(e - s) // 16 + 1 for s, e in key_loops]
    spills = [sum(1 for a, line in instrs if s <= a <= e and re.search(r"\b(LDL|STL)\b", line)) for s, e in key_loops]
    return f"regs {regs:>3}, stack {stack:>4} B, key loop bodies {bodies}, LDL/STL in them {spills}"


def main() -> None:
    print(f"backward kernels for sm_90, D = {D}, p = 2, Triton {triton.__version__}")
    split = BlockConfig(64, 128, 8, 3, tma=True)
    for dtype in DTYPES:
        cfgs = td.default_diff_configs(D, DTYPES[dtype], True)
        launches = [(cfgs.bwd_dkv, 0)] if cfgs.bwd_dk2 is None else [(cfgs.bwd_dkv, 1), (cfgs.bwd_dk2, 2)]
        rows = [(f"default, PART {part}", cfg, compile_diff(dtype, cfg, part)) for cfg, part in launches]
        rows += [(f"split_maps, PART {part}", split, compile_diff(dtype, split, part)) for part in (3, 4)]
        rows += [("PART 1 at split_maps' tile", split, compile_diff(dtype, split, 1))]
        single = default_configs(D, DTYPES[dtype]).bwd_dkv
        rows += [("single op", single, compile_single(dtype, single))]
        rows += [("dQ default", cfgs.bwd_dq, compile_diff_dq(dtype, cfgs.bwd_dq, 0))]
        single = default_configs(D, DTYPES[dtype]).bwd_dq
        rows += [(f"dQ bwd_dq2, MAP {part}", single, compile_diff_dq(dtype, single, part)) for part in (1, 2)]
        rows += [("dQ single op", single, compile_single(dtype, single, "threshold_bwd_dq_kernel"))]
        for label, cfg, compiled in rows:
            tile = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}{' tma' if cfg.tma else ''}"
            print(f"{dtype} {label:28s} {tile:20s} {summary(compiled)}", flush=True)


if __name__ == "__main__":
    main()
