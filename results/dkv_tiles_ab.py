"""dK/dV tiles at D = 128 side by side in one process: the whole backward (dQ at its default tile) with each tile,
interleaved, medians of 5 rounds of `triton.testing.do_bench` (10 ms warm-up, 40 ms), each tile's spread
((max - min) / median) and its time over the first tile's. B * T = 16384, H = 16, q, k, v, dO ~ N(0, 1) (the
bench's sweep inputs). Made dkv_tiles_2026-12-05_h100.txt on one H100 (session 22; lit_thresh/ops/PERF.md v17)
with the two commands below, at the tree before v17 (whose default bf16 D = 128 dK/dV tile was 32x64 w4 s3):

    python results/dkv_tiles_ab.py bfloat16,float16 2048,4096,16384 all
    python results/dkv_tiles_ab.py bfloat16 1024,2048,4096,8192,16384 few

This file is a tidied copy of the session scripts that made it (the same calls and output; the copy itself has
not run on a GPU).
"""

import sys

import torch
import triton

from lit_thresh.bench import _sweep_call, _sweep_inputs, median_spread
from lit_thresh.ops.triton_launch import BlockConfig

TILES = {
    "all": [BlockConfig(32, 64, 4, 3), BlockConfig(32, 64, 4, 3, tma=True), BlockConfig(64, 128, 8, 3),
            BlockConfig(64, 128, 8, 3, tma=True), BlockConfig(64, 128, 8, 2, tma=True),
            BlockConfig(32, 128, 8, 3, tma=True)],
    "few": [BlockConfig(32, 64, 4, 3), BlockConfig(64, 128, 8, 3), BlockConfig(64, 128, 8, 3, tma=True),
            BlockConfig(64, 128, 8, 2, tma=True)],
}


def main(dtypes: list[str], seq_lens: list[int], tiles: list[BlockConfig]) -> None:
    print(torch.cuda.get_device_name(), flush=True)
    for dtype in (getattr(torch, name) for name in dtypes):
        for t in seq_lens:
            torch.manual_seed(0)
            x = _sweep_inputs(16384 // t, 16, t, 128, dtype)
            fns = {cfg: _sweep_call("", "bwd_dkv", cfg, x) for cfg in tiles}
            ms: dict[BlockConfig, list[float]] = {cfg: [] for cfg in fns}
            for _ in range(5):
                for cfg, fn in fns.items():
                    ms[cfg].append(triton.testing.do_bench(fn, warmup=10, rep=40))
            first = median_spread(ms[tiles[0]])[0]
            cells = []
            for cfg, times in ms.items():
                med, spread = median_spread(times)
                cells.append(f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}{' tma' if cfg.tma else ''} "
                             f"{med:.3f} ({spread * 100:.0f}%, x{med / first:.3f})")
            print(f"{str(dtype)[6:]} T={t}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")], TILES[sys.argv[3]])
