"""The single op's dK/dV loop with dP = dO V^T issued before P's dV product (new) against the order before
(main: P, its dV product, then dP); lit_thresh/ops/PERF.md v27. `new` was main at 9d08a5a with one line of
`_bwd_dkv_update` (triton_kernels.py) moved: `dp_t = _mma(v, tl.trans(do), ...)` above `p_t = _rectify(...)`. It
did not gain (0.96-1.016x) and was not adopted, so to run this again make that change in the copy named new.
Output of session 34 (one H100): results/mma_order_ab_2026-12-07_h100.txt.

Offline SASS of the bf16 / fp16 D = 128 default tile (64x128 w8 s3, TMA): main waits for S, spends ~211
instructions on P with no product in flight, issues dV and dP, waits, spends ~50 on dS, issues dK; new waits for S
and dP in turn (~169 instructions between them) and computes dS while dV is in flight. Two versions of the package
in one process (the recipe of results/host_call_plans.py), called as users call them: `threshold_attention` with
beta (H,) learnable, p = 2, scale 1, q, k, v ~ 0.5 N(0, 1) as the bench's grid, H = 16, B * T = 16384, against
SDPA-cuDNN in the same rounds. Gradients of new against main (relative error norm), then forward+backward times:
medians [min - max] of 5 rounds of `triton.testing.do_bench`, interleaved, their order reversed every other round, ms:

    mkdir -p .ab && git archive main lit_thresh | tar -x -C .ab && mv .ab/lit_thresh .ab/lit_thresh_main
    cp -r lit_thresh .ab/lit_thresh_new
    for name in main new; do grep -rl --include=*.py lit_thresh .ab/lit_thresh_$name | xargs sed -i \\
        -e "s/\\blit_thresh\\./lit_thresh_$name./g" -e "s/from lit_thresh import/from lit_thresh_$name import/"; done
    PYTHONPATH=$PWD/.ab:$PYTHONPATH python results/mma_order_ab.py main,new [T,T,...: these lengths only]
"""

import importlib
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from ab import command_line, compiled_versions, interleaved, rel, spread

TOKENS, H, ROUNDS = 16384, 16, 5
SEQ_LENS = (2048, 4096, 16384)
POINTS = [(dtype, d, t) for dtype in ("bfloat16", "float16") for d in (128, 64) for t in SEQ_LENS]


def inputs(dtype: torch.dtype, d: int, t: int, b: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (0.5 * torch.randn(b, H, t, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    beta = torch.full((H,), 0.5, device="cuda")
    return (q, k, v, beta), dout  # (B, H, T, D) each, beta (H,)


def leaves(x):
    return [t.detach().requires_grad_() for t in x]


def fwd_bwd(ops, x, dout):
    """The single op's forward+backward; its inputs, holding their gradients."""
    def run():
        ins = leaves(x)
        ops.threshold_attention(*ins, 2.0).backward(dout)
        return ins
    return run


def cudnn(x, dout):
    def run():
        q, k, v = leaves(x[:3])
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    return run


def warm(task) -> None:
    """Worker: compile one version's kernels at one grid point (B = 1, the same T: the same specialisation)."""
    name, dtype_name, d, t = task
    x, dout = inputs(getattr(torch, dtype_name), d, t, 1)
    fwd_bwd(importlib.import_module(f"lit_thresh_{name}.ops"), x, dout)()
    torch.cuda.synchronize()


def main(names: list[str], seq_lens: tuple[int, ...] = SEQ_LENS) -> None:
    points = [point for point in POINTS if point[2] in seq_lens]
    ops_of = compiled_versions(names, points, warm)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}: "
          f"compiled {len(names) * len(points)} points", flush=True)
    base, new = names
    print(f"dtype     D     T  {base:>24s}  {new:>24s}  {base}/{new}  cuDNN {'':>16s}  x cuDNN {base} -> {new}")
    for dtype_name, d, t in points:
        x, dout = inputs(getattr(torch, dtype_name), d, t, TOKENS // t)
        timed = {name: fwd_bwd(ops, x, dout) for name, ops in ops_of.items()}
        got = {name: [g.grad for g in fn()] for name, fn in timed.items()}
        worst = max(rel(a, b) for a, b in zip(got[new], got[base]))
        timed["cudnn"] = cudnn(x, dout)
        times = interleaved(timed, ROUNDS)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        print(f"{dtype_name:8s} {d:3d} {t:5d}  {spread(times[base])}  {spread(times[new])}  {med[base] / med[new]:.3f}"
              f"  {spread(times['cudnn'])}  {med['cudnn'] / med[base]:.3f} -> {med['cudnn'] / med[new]:.3f}"
              f"  (gradients' largest rel. error norm {worst:.1e})", flush=True)


if __name__ == "__main__":
    main(*command_line(SEQ_LENS))
