"""The fused differential op's backward with dK2 in a second dK/dV launch (KernelConfigs.bwd_dk2), against one
launch computing dK1, dK2 and dV together, at D = 128. Gradients against the single launch's, then the whole
backward (`diff_triton_backward`) per tile pair, and the op's forward+backward with the best pair against the
default and two single calls; bf16 and fp16, H = 16, B * T = 16384, p = 2, beta and lambda (H,) with their
gradients. Medians [min - max] of 3 interleaved rounds of `triton.testing.do_bench`, in ms:

    python results/diff_dk2_split_ab.py
"""

import concurrent.futures
import multiprocessing
import statistics

import torch
import triton

TOKENS, H, D, ROUNDS = 16384, 16, 128, 3
SEQ_LENS = (4096, 16384)
DTYPES = ("bfloat16", "float16")
PART1 = ((32, 64, 4, 2), (64, 64, 8, 2))  # dK1 and dV: (block_m, block_n, warps, stages)
PART2 = ((32, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2))  # dK2 alone


def inputs(dtype: torch.dtype, t: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: 0.5 * torch.randn(TOKENS // t, h, t, D, device="cuda", dtype=dtype, generator=gen)  # (B, H, T, D)
    q1, q2, k1, k2, v, dout = (mk(H) for _ in range(6))
    beta = torch.full((H,), 1.0, device="cuda")
    lam = torch.full((H,), 0.5, device="cuda")
    return q1, q2, k1, k2, v, beta, lam, dout


def configs(dtype: torch.dtype, pair):
    from lit_thresh.ops import triton_differential as td
    from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs

    default = td.default_diff_configs(D, dtype)
    if pair is None:
        return default
    return KernelConfigs(default.fwd, BlockConfig(*pair[0]), default.bwd_dq, BlockConfig(*pair[1]))


def warm(task) -> None:
    """Worker: compile one dtype's kernels for one tile pair (None: the default) at a small T."""
    dtype_name, pair = task
    from lit_thresh.ops import differential_threshold_attention, threshold_attention, triton_launch
    from lit_thresh.ops.triton_differential import diff_triton_backward

    triton_launch.TMA_MIN_WORK = 0  # the single op's TMA kernels, as at the timed sizes
    dtype = getattr(torch, dtype_name)
    q1, q2, k1, k2, v, beta, lam, dout = inputs(dtype, 256)
    diff_triton_backward(q1, q2, k1, k2, v, beta, lam, 2.0, D**-0.5, dout, True, True, configs(dtype, pair))
    if pair is None:  # the ops' forward and backward kernels
        ins = [x.requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
        differential_threshold_attention(*ins, 2.0, scale=D**-0.5).backward(dout)
        threshold_attention(ins[0], ins[2], ins[4], ins[5], 2.0, scale=D**-0.5).backward(dout)
    torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):7.3f} [{min(ts):.3f} - {max(ts):.3f}]"


def main() -> None:
    from lit_thresh.ops import differential_threshold_attention, threshold_attention
    from lit_thresh.ops import triton_differential as td
    from lit_thresh.ops.triton_differential import diff_triton_backward

    pairs = [None] + [(p1, p2) for p1 in PART1 for p2 in PART2]
    tasks = [(dt, pair) for dt in DTYPES for pair in pairs]
    with concurrent.futures.ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(warm, tasks))
    print(f"{torch.cuda.get_device_name()}: compiled {len(tasks)} configurations", flush=True)

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for t in SEQ_LENS:
            q1, q2, k1, k2, v, beta, lam, dout = inputs(dtype, t)
            args = (q1, q2, k1, k2, v, beta, lam, 2.0, D**-0.5, dout, True, True)
            one = diff_triton_backward(*args, configs(dtype, None))
            names = ("dq1", "dq2", "dk1", "dk2", "dv", "dbeta", "dlam")
            worst = max(rel(a, b) for pair in pairs[1:] for a, b in zip(diff_triton_backward(*args, configs(dtype, pair)), one))
            print(f"\n{dtype_name} D={D} T={t}: every split pair's gradients against one launch's, largest relative "
                  f"error norm {worst:.2e} ({', '.join(names)})", flush=True)
            times = {pair: [] for pair in pairs}
            for _ in range(ROUNDS):
                for pair in pairs:
                    cfgs = configs(dtype, pair)
                    times[pair].append(bench(lambda: diff_triton_backward(*args, cfgs)))
            base = statistics.median(times[None])
            print("  backward (diff_triton_backward), ms: median [min - max], x one launch's time")
            for pair, ts in times.items():
                c = configs(dtype, None).bwd_dkv
                label = f"one launch ({c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages})" if pair is None \
                    else f"dK1+dV {pair[0]}, dK2 {pair[1]}"
                print(f"    {label:60s} {spread(ts)}  {statistics.median(ts) / base:.3f}")
            best = min(pairs[1:], key=lambda p: statistics.median(times[p]))

            # the op's forward+backward: default configs, the best pair, two single calls
            ops = {}
            for label, pair in (("fused, one dK/dV launch", None), (f"fused, split {best}", best)):
                cfgs = configs(dtype, pair)

                def run(cfgs=cfgs):
                    saved = td.default_diff_configs
                    td.default_diff_configs = lambda head_dim, dt: cfgs
                    try:
                        ins = [x.detach().requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
                        differential_threshold_attention(*ins, 2.0, scale=D**-0.5).backward(dout)
                    finally:
                        td.default_diff_configs = saved
                ops[label] = run

            def two_calls():
                ins = [x.detach().requires_grad_() for x in (q1, q2, k1, k2, v, beta, lam)]
                out = threshold_attention(ins[0], ins[2], ins[4], ins[5], 2.0, scale=D**-0.5)
                out = out - ins[6].view(-1, 1, 1) * threshold_attention(ins[1], ins[3], ins[4], ins[5], 2.0, scale=D**-0.5)
                out.backward(dout)
            ops["two single calls"] = two_calls
            op_times = {label: [] for label in ops}
            for _ in range(ROUNDS):
                for label, fn in ops.items():
                    op_times[label].append(bench(fn))
            two = statistics.median(op_times["two single calls"])
            print("  forward+backward through the ops, ms, and two single calls' time / this")
            for label, ts in op_times.items():
                print(f"    {label:60s} {spread(ts)}  {two / statistics.median(ts):.3f}")


if __name__ == "__main__":
    main()
