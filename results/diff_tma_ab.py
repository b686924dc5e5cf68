"""The fused differential op at its v25 default tiles (for large calls, TMA loads where the sweep found them >= 3%
faster) against the previous defaults: two versions of the package in one process (the recipe of results/host_call_plans.py,
main = the commit before, new = the working tree), called as users call them: `differential_threshold_attention`
with beta and lambda (H,) learnable, p = 2, H = 16, B * T = 16384: bf16 and fp16 D = 64 and fp16 D = 128 at
T = 1024, 2048, 4096 and 16384, and bf16 D = 128 (no tile changed) at T = 16384 as a control. Outputs and gradients of
new against main (relative error norm; other tiles, so not bit for bit), then the forward and forward+backward
times, with two single calls (new's) for scale. Medians [min - max] of 5 rounds of `triton.testing.do_bench`, the
versions interleaved, their order reversed every other round, ms:

    PYTHONPATH=$PWD/.ab:$PYTHONPATH python results/diff_tma_ab.py main,new [T,T,...: these lengths only]
"""

import importlib
import statistics

import torch

from ab import command_line, compiled_versions, interleaved, rel, spread

TOKENS, H, ROUNDS = 16384, 16, 5
SEQ_LENS = (1024, 2048, 4096, 16384)
POINTS = [(dtype, 64, t) for dtype in ("bfloat16", "float16") for t in SEQ_LENS]
POINTS += [("float16", 128, t) for t in SEQ_LENS] + [("bfloat16", 128, 16384)]  # the last: no tile changed


def inputs(dtype: torch.dtype, d: int, t: int, b: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q1, q2, k1, k2, v, dout = (0.5 * torch.randn(b, H, t, d, device="cuda", dtype=dtype, generator=gen)
                               for _ in range(6))  # (B, H, T, D)
    beta = torch.linspace(0.5, 1.5, H, device="cuda")
    lam = torch.linspace(0.2, 0.6, H, device="cuda")
    return (q1, q2, k1, k2, v, beta, lam), dout


def calls(ops, x, dout, d: int) -> dict:
    """The op's forward, its forward+backward (every gradient), and two single calls' forward+backward."""
    def leaves():
        return [t.detach().requires_grad_() for t in x]

    def fwd_bwd():
        ins = leaves()
        ops.differential_threshold_attention(*ins, 2.0, scale=d**-0.5).backward(dout)
        return ins

    def two_calls():
        q1, q2, k1, k2, v, beta, lam = leaves()
        a1 = ops.threshold_attention(q1, k1, v, beta, 2.0, scale=d**-0.5)
        (a1 - lam[:, None, None] * ops.threshold_attention(q2, k2, v, beta, 2.0, scale=d**-0.5)).backward(dout)

    return {"forward": lambda: ops.differential_threshold_attention(*x, 2.0, scale=d**-0.5),
            "forward+backward": fwd_bwd, "two single calls, forward+backward": two_calls}


def warm(task) -> None:
    """Worker: compile one version's kernels at one grid point (B = 1, the same T: the same specialisation)."""
    name, dtype_name, d, t = task
    ops = importlib.import_module(f"lit_thresh_{name}.ops")
    x, dout = inputs(getattr(torch, dtype_name), d, t, 1)
    for fn in calls(ops, x, dout, d).values():
        fn()
    torch.cuda.synchronize()


def main(names: list[str], seq_lens: tuple[int, ...] = SEQ_LENS) -> None:
    points = [point for point in POINTS if point[2] in seq_lens]
    ops_of = compiled_versions(names, points, warm)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: compiled {len(names) * len(points)} points",
          flush=True)
    base, new = names
    for dtype_name, d, t in points:
        x, dout = inputs(getattr(torch, dtype_name), d, t, TOKENS // t)
        runs = {name: calls(ops, x, dout, d) for name, ops in ops_of.items()}
        got = {name: [run["forward"](), *[g.grad for g in run["forward+backward"]()]] for name, run in runs.items()}
        worst = max(rel(a, b) for a, b in zip(got[new], got[base]))
        print(f"\n{dtype_name} D={d} T={t}: {new} against {base}, largest relative error norm of the output and the "
              f"7 gradients {worst:.1e}", flush=True)
        timed = {(name, case): fn for name, run in runs.items() for case, fn in run.items()
                 if name == new or not case.startswith("two")}
        times = interleaved(timed, ROUNDS)
        for case in ("forward", "forward+backward"):
            ratio = statistics.median(times[(base, case)]) / statistics.median(times[(new, case)])
            print(f"  {case:18s} {base} {spread(times[(base, case)])}  {new} {spread(times[(new, case)])}  "
                  f"{base} / {new} {ratio:.3f}")
        two = times[(new, "two single calls, forward+backward")]
        print(f"  two single calls, forward+backward {spread(two)}: / fused {base} "
              f"{statistics.median(two) / statistics.median(times[(base, 'forward+backward')]):.3f}, / fused {new} "
              f"{statistics.median(two) / statistics.median(times[(new, 'forward+backward')]):.3f}", flush=True)


if __name__ == "__main__":
    main(*command_line(SEQ_LENS))
