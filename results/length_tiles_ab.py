"""Tiles by sequence length: the single op's default tile of each kernel against the candidates the length
sweep found at T = 1024 and 16384 (`python -m lit_thresh.bench --sweep --sweep-ops single --no-table --no-host
--quick --seq-lens 1024 16384`), at every T of the grid. Per (dtype, D, kernel, T): the forward, or the whole
backward with the other backward kernels at their defaults (the bench's `_sweep_call`), each candidate timed
interleaved with the baseline (the long maps' default) and with the baseline again, a control for the
harness's own bias, in ROUNDS rounds of `triton.testing.do_bench`, the order reversed every other round;
time / the baseline's time, median [min - max] over the rounds. H = 16, B * T = 16384, p = 2, beta (H,) with its gradient, explicit configs (the
TMA flag as given, at every size). Then a torch.profiler view of the fp16 forward at D = 128 (the row-norm
pre-pass against the kernel), with bf16's kernel beside it:

    python results/length_tiles_ab.py
"""

import concurrent.futures
import multiprocessing
import statistics

import torch
import triton

from lit_thresh import bench
from lit_thresh.ops.triton_launch import BlockConfig, default_configs

TOKENS, H, ROUNDS = 16384, 16, 4
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
CANDIDATES = {  # (dtype, D) -> kernel -> tiles (block_m, block_n, warps, stages, tma) tried against the default
    ("bfloat16", 64): {"fwd": [(128, 64, 8, 3, False)],
                       "bwd_dkv": [(64, 64, 4, 3, False), (64, 64, 4, 4, False), (64, 64, 4, 3, True)]},
    ("bfloat16", 128): {"fwd": [(64, 64, 4, 3, True), (128, 32, 4, 3, True)],
                        "bwd_dkv": [(32, 64, 4, 3, True)]},
    ("float16", 64): {"fwd": [(128, 64, 4, 3, True)],
                      "bwd_dkv": [(32, 64, 4, 3, True)],
                      "bwd_dq": [(128, 64, 8, 3, False), (64, 64, 4, 3, True)]},
    ("float16", 128): {"fwd": [(64, 64, 4, 3, True), (128, 32, 4, 3, True)],
                       "bwd_dkv": [(32, 64, 4, 3, True)]},
}


def cases():
    """(dtype name, D, kernel, [baseline, the baseline again (a control), candidates...]); the baseline is the
    long maps' default."""
    for (name, d), kernels in CANDIDATES.items():
        for kernel, tiles in kernels.items():
            default = getattr(default_configs(d, getattr(torch, name)), kernel)
            yield name, d, kernel, [default, default] + [BlockConfig(*tile[:4], tma=tile[4]) for tile in tiles]


def label(cfg: BlockConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")


def timed_tables() -> None:
    tasks = [("", kernel, cfg, H, 256, d, name) for name, d, kernel, cfgs in cases() for cfg in cfgs]
    with concurrent.futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in pool.map(bench._compile_one, tasks) if e]
    print("compile errors:", errors or "none", flush=True)
    timing = bench.Timing(10, 40)
    print(f"time / the default's, median [min - max] of {ROUNDS} interleaved rounds (default: ms)")
    for name, d, kernel, cfgs in cases():
        for t in SEQ_LENS:
            x = bench._sweep_inputs(TOKENS // t, H, t, d, getattr(torch, name))
            calls = [bench._sweep_call("", kernel, cfg, x) for cfg in cfgs]
            times = [[] for _ in cfgs]
            for r in range(ROUNDS):  # the order reversed every other round: no config always first
                for i in (range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))):
                    times[i].append(bench._median_ms(calls[i], [], timing))
            base = statistics.median(times[0])
            cells = [f"baseline {label(cfgs[0])} {base:.3f} ms [{min(times[0]) / base:.3f}-{max(times[0]) / base:.3f}]"]
            for i, (cfg, ts) in enumerate(zip(cfgs[1:], times[1:])):
                ratios = [x / base for x in ts]
                name_i = "again" if i == 0 else label(cfg)
                cells.append(f"{name_i} {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
            print(f"{name:8} D={d:<3} {kernel:7} T={t:<5} | " + " | ".join(cells), flush=True)


def forward_profile() -> None:
    """CUDA time per call of each kernel of the forward (20 calls), fp16 and bf16, D = 128."""
    from torch.profiler import ProfilerActivity, profile

    from lit_thresh.ops.triton_launch import triton_forward

    print("\nforward at D = 128, CUDA us per call by kernel (torch.profiler, 20 calls)")
    for t in (1024, 4096):
        for name in ("bfloat16", "float16"):
            x = bench._sweep_inputs(TOKENS // t, H, t, 128, getattr(torch, name))
            call = lambda: triton_forward(x["q"], x["k"], x["v"], x["beta"], 2.0, 1.0)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            per = {e.key: e.device_time_total / 20 for e in prof.key_averages() if e.device_time_total > 0}
            ms = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
            print(f"  {name:8} T={t:<5} do_bench {ms * 1e3:7.1f} us | "
                  + " | ".join(f"{k[:28]} {v:7.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    timed_tables()
    forward_profile()
