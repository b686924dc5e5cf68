"""Eager calls at growing sizes, the default tiles with TMA loads forced on and off: host time per call (a loop
without sync) and wall time per call (the loop, then a sync), medians of 3 loops, the two modes interleaved.
Made results/tma_crossover_2026-12-02.txt on one H200 (session 19; lit_thresh/ops/PERF.md v14):

    python results/tma_crossover.py tma_crossover_2026-12-02.txt

This file is a tidied copy of the session script that made it (the same steps and output; the copy itself has
not run on a GPU), which forced the modes through the constant's first name, TMA_MIN_SCORES, the same way."""

import statistics
import sys
import time
from collections.abc import Callable

import torch

from lit_thresh.ops import threshold_attention, triton_launch

CASES = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128)]
SIZES = [(1, 2, 128), (1, 16, 512), (1, 16, 1024), (1, 16, 2048), (4, 16, 2048), (4, 16, 4096)]  # (B, H, T)


def set_loads(mode: str) -> None:
    """Force the default tiles' loads: 'pointers' or 'tma'."""
    triton_launch.TMA_MIN_WORK = 1 << 62 if mode == "pointers" else 0


def loop(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(host us, wall us) per call of n calls: the loop alone, then the loop and a sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / n * 1e6, wall / n * 1e6


def main(path: str) -> None:
    default = triton_launch.TMA_MIN_WORK
    with open(path, "w") as out:
        def say(line: str) -> None:
            print(line, file=out, flush=True)
            print(line, flush=True)

        say("dtype D B H T scores | call | mode | host us | wall us  (medians of 3 loops)")
        for dtype, d in CASES:
            for b, h, t in SIZES:
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))  # (B, H, T, D)
                beta = torch.full((h,), 0.5, device="cuda", requires_grad=True)
                calls = {"fwd": lambda: threshold_attention(q.detach(), k.detach(), v.detach(), beta.detach(), 2.0),
                         "fwd+bwd": lambda: threshold_attention(q, k, v, beta, 2.0).backward(do)}
                for name, fn in calls.items():
                    res: dict[str, list[tuple[float, float]]] = {"pointers": [], "tma": []}
                    for mode in res:  # warm-up (and compile) in both modes
                        set_loads(mode)
                        for _ in range(3):
                            fn()
                    _, wall = loop(fn, 3)
                    n = max(5, min(400, int(60000 / max(wall, 1))))  # ~60 ms a loop
                    for _ in range(3):
                        for mode in res:
                            set_loads(mode)
                            res[mode].append(loop(fn, n))
                    for mode, r in res.items():
                        walls = [w for _, w in r]
                        say(f"{str(dtype)[6:]} {d} {b} {h} {t} 2^{(b * h * t * t).bit_length() - 1} | {name} | {mode} | "
                            f"{statistics.median(x for x, _ in r):.1f} | {statistics.median(walls):.1f} "
                            f"[{min(walls):.1f}-{max(walls):.1f}]")
    triton_launch.TMA_MIN_WORK = default


if __name__ == "__main__":
    main(sys.argv[1])
