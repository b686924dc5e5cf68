"""The fused differential op's backward in more, lighter launches that each read one map, as the single op's
kernels do (PERF.md v26), against the default launches (one dK/dV launch, or at bf16 D = 128 dK1 and dV, then dK2;
one dQ launch): KernelConfigs.split_maps (dK1 and map 1's term of dV, then dK2 and map 2's term added; both
launches at one tile) and bwd_dq2 (dQ1 from map 1, then dQ2 and dlambda from map 2, both at the single op's dQ
tile), alone and together. Gradients of each variant against the default's (relative error norm; split_maps
rounds dV once more), then the whole backward (`diff_triton_backward`) per variant; then the op's forward+backward
with the fastest variant against the default and two single calls. bf16 and fp16, H = 16, B * T = 16384, p = 2,
beta and lambda (H,) with their gradients. Medians [min - max] of 5 interleaved rounds of
`triton.testing.do_bench`, the order reversed every other round, in ms:

    python results/diff_split_maps_ab.py

It ran on the tree at 4a5cf40 (`git checkout 4a5cf40` to run it again), output in
results/diff_split_maps_ab_2026-12-07_h100.txt. After it, split_maps became D = 128's large-call default and
bwd_dq2 was removed (PERF.md v26), so on later trees it does not run as written.
"""

import concurrent.futures
import multiprocessing
import statistics
from dataclasses import replace

import torch
import triton

TOKENS, H, ROUNDS = 16384, 16, 5
POINTS = [(dtype, 128, t) for dtype in ("bfloat16", "float16") for t in (4096, 16384)]
POINTS += [("bfloat16", 64, 16384), ("float16", 64, 16384)]
VARIANTS = {  # (split_maps' tile for both dK/dV launches or None, bwd_dq2): (block_m, block_n, warps, stages), TMA
    128: (((64, 128, 8, 3), False), ((64, 128, 8, 2), False), ((64, 64, 8, 3), False), (None, True),
          ((64, 128, 8, 3), True), ((64, 128, 8, 2), True)),
    64: (((32, 64, 4, 3), False), ((64, 64, 4, 4), False), (None, True), ((32, 64, 4, 3), True)),
}


def inputs(dtype: torch.dtype, d: int, t: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q1, q2, k1, k2, v, dout = (0.5 * torch.randn(TOKENS // t, H, t, d, device="cuda", dtype=dtype, generator=gen)
                               for _ in range(6))  # (B, H, T, D)
    beta = torch.linspace(0.5, 1.5, H, device="cuda")
    lam = torch.linspace(0.2, 0.6, H, device="cuda")
    return q1, q2, k1, k2, v, beta, lam, dout


def configs(dtype: torch.dtype, d: int, variant):
    """The default configs of a large call (variant None), or with split_maps at a tile and / or bwd_dq2."""
    from lit_thresh.ops import triton_differential as td
    from lit_thresh.ops.triton_launch import BlockConfig, default_configs

    cfgs = td.default_diff_configs(d, dtype, True)
    if variant is None:
        return cfgs
    tile, dq2 = variant
    if tile is not None:
        cfgs = replace(cfgs, bwd_dkv=BlockConfig(*tile, tma=True), bwd_dk2=BlockConfig(*tile, tma=True), split_maps=True)
    if dq2:
        single = default_configs(d, dtype).bwd_dq  # the single op's long-map dQ tile
        cfgs = replace(cfgs, bwd_dq=single, bwd_dq2=single)
    return cfgs


def label(dtype: torch.dtype, d: int, variant) -> str:
    cfgs = configs(dtype, d, variant)
    tile = lambda c: f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}{' tma' if c.tma else ''}"
    parts = [f"split_maps {tile(cfgs.bwd_dkv)}"] if variant[0] else []
    return " + ".join(parts + ([f"bwd_dq2 {tile(cfgs.bwd_dq)}"] if variant[1] else []))


def warm(task) -> None:
    """Worker: compile one point's backward at one variant (None: the default, and the ops' kernels) at a small T."""
    dtype_name, d, variant = task
    from lit_thresh.ops import differential_threshold_attention, threshold_attention, triton_launch
    from lit_thresh.ops.triton_differential import diff_triton_backward

    triton_launch.TMA_MIN_WORK = 0  # TMA kernels, as at the timed sizes
    dtype = getattr(torch, dtype_name)
    q1, q2, k1, k2, v, beta, lam, dout = inputs(dtype, d, 256)
    diff_triton_backward(q1, q2, k1, k2, v, beta, lam, 2.0, d**-0.5, dout, True, True, configs(dtype, d, variant))
    if variant is None:
        ins = [x.requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
        differential_threshold_attention(*ins, 2.0, scale=d**-0.5).backward(dout)
        threshold_attention(ins[0], ins[2], ins[4], ins[5], 2.0, scale=d**-0.5).backward(dout)
    torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):7.3f} [{min(ts):.3f} - {max(ts):.3f}]"


def interleaved(fns: dict) -> dict:
    times = {key: [] for key in fns}
    for r in range(ROUNDS):
        for key in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[key].append(triton.testing.do_bench(fns[key], warmup=25, rep=100))
    return times


def main() -> None:
    from lit_thresh.ops import differential_threshold_attention, threshold_attention
    from lit_thresh.ops import triton_differential as td
    from lit_thresh.ops.triton_differential import diff_triton_backward

    tasks = sorted({(dt, d, variant) for dt, d, _ in POINTS for variant in (None, *VARIANTS[d])}, key=str)
    with concurrent.futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(warm, tasks))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: compiled {len(tasks)} configurations", flush=True)

    for dtype_name, d, t in POINTS:
        dtype = getattr(torch, dtype_name)
        q1, q2, k1, k2, v, beta, lam, dout = inputs(dtype, d, t)
        args = (q1, q2, k1, k2, v, beta, lam, 2.0, d**-0.5, dout, True, True)
        variants = (None, *VARIANTS[d])
        default = diff_triton_backward(*args, configs(dtype, d, None))
        worst = {var: max(rel(a, b) for a, b in zip(diff_triton_backward(*args, configs(dtype, d, var)), default))
                 for var in variants[1:]}
        times = interleaved({var: (lambda c=configs(dtype, d, var): diff_triton_backward(*args, c)) for var in variants})
        base = statistics.median(times[None])
        c = configs(dtype, d, None)
        launches = "one dK/dV launch" if c.bwd_dk2 is None else "dK1+dV, then dK2"
        print(f"\n{dtype_name} D={d} T={t}: backward (diff_triton_backward), ms, x the default's time; largest "
              f"relative error norm of the 7 gradients against the default's")
        print(f"  {'default (' + launches + ', one dQ launch)':64s} {spread(times[None])}")
        for var in variants[1:]:
            print(f"  {label(dtype, d, var):64s} {spread(times[var])}  {statistics.median(times[var]) / base:.3f}  "
                  f"{worst[var]:.1e}")
        best = min(variants[1:], key=lambda var: statistics.median(times[var]))

        def op(cfgs):
            def run():
                saved = td.default_diff_configs
                td.default_diff_configs = lambda *a, **k: cfgs
                try:
                    ins = [x.detach().requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
                    differential_threshold_attention(*ins, 2.0, scale=d**-0.5).backward(dout)
                finally:
                    td.default_diff_configs = saved
            return run

        def two_calls():
            ins = [x.detach().requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
            out = threshold_attention(ins[0], ins[2], ins[4], ins[5], 2.0, scale=d**-0.5)
            out = out - ins[6].view(-1, 1, 1) * threshold_attention(ins[1], ins[3], ins[4], ins[5], 2.0, scale=d**-0.5)
            out.backward(dout)

        ops = {"fused, default": op(configs(dtype, d, None)),
               f"fused, {label(dtype, d, best)}": op(configs(dtype, d, best)),
               "two single calls": two_calls}
        op_times = interleaved(ops)
        two = statistics.median(op_times["two single calls"])
        print("  forward+backward through the ops, ms, and two single calls' time / this")
        for name, ts in op_times.items():
            print(f"    {name:64s} {spread(ts)}  {two / statistics.median(ts):.3f}", flush=True)


if __name__ == "__main__":
    main()
