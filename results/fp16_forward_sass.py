"""Where the fp16 forward kernel's instructions differ from bf16's, offline (no GPU: Triton compiles for sm_90
and its bundled cuobjdump disassembles). threshold_fwd_kernel at bf16's long-map default tiles, p = 2, pointer
loads, in bf16, in fp16 with its row scales (ROW_SCALE, as it runs) and in fp16 without them: the instruction
count of the whole kernel, of what runs before its first key loop (the prologue), of each key loop's body
(the loops holding the HGMMAs: unmasked, then the diagonal) and of the other loops (the row-norm scan), and
the most frequent opcodes:

    python results/fp16_forward_sass.py
"""

import collections
import os
import re
import subprocess
import sys

import torch
import triton

from lit_thresh.ops import triton_kernels
from lit_thresh.ops.triton_launch import _single_metas, default_configs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for tests.ops
from tests.ops.sm90 import compile_for_sm90, sass_loops  # noqa: E402  (the compile tests' signature builder)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sass(d: int, dtype: torch.dtype, row_scale: bool) -> tuple[str, str]:
    """(the tiles, the SASS) of the forward kernel at D = Dv = d."""
    cfg = default_configs(d, torch.bfloat16, 8192).fwd
    kernel = triton_kernels.threshold_fwd_kernel
    meta, _ = _single_metas(d, d, 2.0, dtype, "ieee", False)
    consts = dict(meta, ROW_SCALE=row_scale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SKIP_ZERO=False, USE_TMA=False)
    compiled = compile_for_sm90(kernel, consts, "bf16" if dtype == torch.bfloat16 else "fp16", "fp32", specialise=True,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    path = f"/tmp/fp16_forward_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    os.remove(path)
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}", text


def summary(text: str) -> str:
    instrs, loops, key_loops = sass_loops(text)
    prologue = sum(1 for addr, _ in instrs if addr < key_loops[0][0])
    bodies = [(e - s) // 16 + 1 for s, e in key_loops]
    others = [(e - s) // 16 + 1 for s, e in loops if (s, e) not in key_loops]
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line).group(1)
                              for _, line in instrs)
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
    return (f"{len(instrs)} instructions, prologue {prologue}, key loop bodies {bodies}, other loops {others}; "
            f"{top}")


def main() -> None:
    print("threshold_fwd_kernel for sm_90, p = 2, pointer loads, Triton", triton.__version__)
    for d in (64, 128):
        for label, dtype, row_scale in (("bf16", torch.bfloat16, False), ("fp16, row scales", torch.float16, True),
                                        ("fp16, no row scales", torch.float16, False)):
            tiles, text = sass(d, dtype, row_scale)
            print(f"D = {d:<3} {tiles} {label:<20} {summary(text)}", flush=True)


if __name__ == "__main__":
    main()
