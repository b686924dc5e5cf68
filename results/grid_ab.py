"""The order in which the single op's kernels run their tiles, and persistent grids; lit_thresh/ops/PERF.md v28-v29.
Versions of the package in one process (copies renamed lit_thresh_<name>; only main is in the repository, the
others are changes described here, made in copies):

- main: grid (tiles, B * H). The hardware deals programs in launch order (grid x fastest), so each (batch, head)'s
  tiles run longest first (the forward and dQ kernels' last query rows, the dK/dV kernel's first keys), one
  (batch, head) after another.
- order: the grid's axes swapped, (B * H, tiles), so the longest tiles of every (batch, head) run first, then the
  next longest, and so on. In each kernel pid_bh = tl.program_id(0), the tile from tl.program_id(1) and
  tl.num_programs(1); the launchers' grids swapped.
- new: persistent grids. Each kernel launches at most the programs the device holds at once (SMs x programs per SM
  by shared memory, registers and threads of the compiled kernel) and each program loops over tiles in order's
  order, dealt round by round in snake order (round r: programs 0..G-1 when r is even, G-1..0 when odd). Each
  kernel's body became a @triton.jit helper taking (tile index, batch*head, tiles per head); the kernel takes one
  more scalar, N_BH, and loops `for t0 in range(0, total, G)`, t = t0 + (c or G - 1 - c by round), calling the
  helper where t < total; the launchers pass grid (total tiles, 1) and FastLaunch launches min(total, resident)
  programs once it holds the compiled kernel (the first call, through Triton's runner, launches one per tile).
- swz (the branch grid-grouped, e701f25; run in session 38): order within groups of HEAD_GROUP (batch, head)s, a
  group after another (the grouped order of Triton's matmul tutorial), HEAD_GROUP the largest power of two, at most
  B * H, whose keys and values fill at most half of L2. A 1-D grid of every tile; a helper maps the program id to
  (rank, batch*head); the kernels take HEAD_GROUP as one more scalar.
- swzb (the branch grid-grouped-bwd, c6c01f8, and on g1d's grids grid-grouped-bwd-1d, 6903330; not yet run): swz
  with the forward in main's order.
- g1d (the branch grid-1d, b4dc453; not yet run): main's order on 1-D grids (PERF.md v29).
- ctl: main again, a control.

Called as users call them: `threshold_attention`, beta (H,) learnable, p = 2, H = 16, B * T = 16384,
q, k, v ~ 0.5 N(0, 1), against SDPA-cuDNN in the same rounds. Output and gradients of each version against main
(relative error norm), then forward and forward+backward times: medians [min - max] of 5 rounds of
`triton.testing.do_bench`, interleaved, their order reversed every other round, ms:

    mkdir -p .ab && git archive main lit_thresh | tar -x -C .ab && mv .ab/lit_thresh .ab/lit_thresh_main
    cp -r lit_thresh .ab/lit_thresh_order   # and so on, each with its change
    git archive grid-grouped lit_thresh | tar -x -C .ab && mv .ab/lit_thresh .ab/lit_thresh_swz   # a branch's
    for name in main order new; do grep -rl --include=*.py lit_thresh .ab/lit_thresh_$name | xargs sed -i \\
        -e "s/\\blit_thresh\\./lit_thresh_$name./g" -e "s/from lit_thresh import/from lit_thresh_$name import/"; done
    PYTHONPATH=$PWD/.ab:$PYTHONPATH python results/grid_ab.py main,order,new 1024,4096,16384

Outputs (one H100): results/grid_ab_2026-12-07_h100.txt (session 37: main,order,new 1024,4096,16384),
results/grid_ab_2026-12-07b_h100.txt (session 38: main,swz at every T, run in results/ with PYTHONPATH=$PWD/../.ab).
"""

import importlib
import statistics

import torch
import triton

from ab import (command_line, compiled_versions, cudnn_call, interleaved, leaves, rel, single_fwd_bwd, single_inputs,
                spread, warm_single)

TOKENS, ROUNDS = 16384, 5
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
POINTS = [(dtype, d, t) for dtype in ("bfloat16", "float16") for d in (128, 64) for t in SEQ_LENS]


def forward(ops, x):
    """One version's forward, its inputs holding gradients as in training."""
    ins = leaves(x)
    return lambda: ops.threshold_attention(*ins, 2.0)


def main(names: list[str], seq_lens: tuple[int, ...] = SEQ_LENS) -> None:
    points = [point for point in POINTS if point[2] in seq_lens]
    ops_of = compiled_versions(names, points, warm_single)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}: "
          f"compiled {len(names) * len(points)} points", flush=True)
    base, others = names[0], names[1:]
    print(f"dtype     D     T  pass     {base:>24s}  " + "  ".join(f"{n:>24s}  {base}/{n}" for n in others)
          + f"  cuDNN {'':>18s}  x cuDNN " + ", ".join(names))
    ratios = {n: [] for n in others}
    for dtype_name, d, t in points:
        x, dout = single_inputs(getattr(torch, dtype_name), d, t, TOKENS // t)
        for n in others:
            launchers = importlib.import_module(f"lit_thresh_{n}.ops.triton_launch")
            if hasattr(launchers, "head_group"):
                print(f"{n}: head_group {launchers.head_group(*x[:3], x[0].shape[0] * x[0].shape[1])}", flush=True)
        got = {name: [r.grad if i else r for i, r in enumerate(single_fwd_bwd(ops, x, dout)())]  # output, gradients
               for name, ops in ops_of.items()}
        worst = max(rel(a, b) for n in others for a, b in zip(got[n], got[base]))
        for label, backward in (("fwd", False), ("fwd+bwd", True)):
            timed = {name: single_fwd_bwd(ops, x, dout) if backward else forward(ops, x)
                     for name, ops in ops_of.items()}
            timed["cudnn"] = cudnn_call(x, dout, backward)
            times = interleaved(timed, ROUNDS)
            med = {key: statistics.median(ts) for key, ts in times.items()}
            for n in others:
                ratios[n].append(med[base] / med[n])
            print(f"{dtype_name:8s} {d:3d} {t:5d}  {label:7s}  {spread(times[base])}  "
                  + "  ".join(f"{spread(times[n])}  {med[base] / med[n]:.3f}" for n in others)
                  + f"  {spread(times['cudnn'])}  " + ", ".join(f"{med['cudnn'] / med[n]:.3f}" for n in names)
                  + f"  (output and gradients' largest rel. error norm {worst:.1e})", flush=True)
    for n, rs in ratios.items():
        print(f"{base}/{n} over {len(rs)} rows: median {statistics.median(rs):.3f}, "
              f"range {min(rs):.3f} - {max(rs):.3f}")
    for n in others:
        launchers = importlib.import_module(f"lit_thresh_{n}.ops.triton_launch")
        sized = sorted({(kernel, meta.get("BLOCK_M"), meta.get("BLOCK_N"), compiled.metadata.num_warps,
                         compiled.n_regs, compiled.metadata.shared, getattr(compiled, "_resident", "one per tile"))
                        for kernel in ("_FWD", "_BWD_DKV", "_BWD_DQ")
                        for compiled, _, meta in getattr(launchers, kernel).entries.values()})
        for kernel, bm, bn, warps, regs, shared, resident in sized:  # what the persistent grids were sized by
            print(f"{n}: {kernel:8s} {bm}x{bn} w{warps}: {regs} registers, {shared} B shared -> {resident} programs")


if __name__ == "__main__":
    main(*command_line(SEQ_LENS))
