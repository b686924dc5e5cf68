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

import statistics

import torch
import triton

from ab import (command_line, compiled_versions, cudnn_call, interleaved, rel, single_fwd_bwd, single_inputs, spread,
                warm_single)

TOKENS, ROUNDS = 16384, 5
SEQ_LENS = (2048, 4096, 16384)
POINTS = [(dtype, d, t) for dtype in ("bfloat16", "float16") for d in (128, 64) for t in SEQ_LENS]


def main(names: list[str], seq_lens: tuple[int, ...] = SEQ_LENS) -> None:
    points = [point for point in POINTS if point[2] in seq_lens]
    ops_of = compiled_versions(names, points, warm_single)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}: "
          f"compiled {len(names) * len(points)} points", flush=True)
    base, new = names
    print(f"dtype     D     T  {base:>24s}  {new:>24s}  {base}/{new}  cuDNN {'':>16s}  x cuDNN {base} -> {new}")
    for dtype_name, d, t in points:
        x, dout = single_inputs(getattr(torch, dtype_name), d, t, TOKENS // t)
        timed = {name: single_fwd_bwd(ops, x, dout) for name, ops in ops_of.items()}
        got = {name: [g.grad for g in fn()[1:]] for name, fn in timed.items()}
        worst = max(rel(a, b) for a, b in zip(got[new], got[base]))
        timed["cudnn"] = cudnn_call(x, dout)
        times = interleaved(timed, ROUNDS)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        print(f"{dtype_name:8s} {d:3d} {t:5d}  {spread(times[base])}  {spread(times[new])}  {med[base] / med[new]:.3f}"
              f"  {spread(times['cudnn'])}  {med['cudnn'] / med[base]:.3f} -> {med['cudnn'] / med[new]:.3f}"
              f"  (gradients' largest rel. error norm {worst:.1e})", flush=True)


if __name__ == "__main__":
    main(*command_line(SEQ_LENS))
