"""Where the fp16 forward kernel's time over bf16's goes: the forward kernel alone (its launch timed, the
row-norm pre-pass made before), at bf16's default tiles for every dtype, in bf16, in fp16 with its row
scales (as it runs), and in fp16 with them switched off (ROW_SCALE false: a diagnostic only, safe on these
inputs, whose P stays far inside fp16's range). H = 16, B * T = 16384, p = 2, q, k, v ~ 0.5 N(0, 1), beta
(H,); interleaved in ROUNDS rounds of `triton.testing.do_bench`, the order reversed every other round; ms,
median [min - max] over the rounds:

    python results/fp16_forward_kernel.py
"""

import statistics

import torch
import triton

from lit_thresh.ops import triton_launch

TOKENS, H, ROUNDS = 16384, 16, 5


def main() -> None:
    print("| D | T | tiles | bf16 | fp16, row scales | fp16, no row scales | fp16 unscaled outputs vs scaled |")
    print("|---|---|---|---|---|---|---|")
    for d in (64, 128):
        for t in (1024, 4096, 16384):
            b = TOKENS // t
            gen = torch.Generator(device="cuda").manual_seed(d + t)
            base = [0.5 * torch.randn(b, H, t, d, device="cuda", generator=gen) for _ in range(3)]
            beta = torch.full((H,), 0.5, device="cuda")
            configs = triton_launch.default_configs(d, torch.bfloat16, t)
            fns, outs = {}, {}
            for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                q, k, v = (x.to(dtype) for x in base)
                grid, tensors, scalars, kw, use_tma, out, _ = triton_launch._forward_launch(
                    q, k, v, beta, 2.0, d ** -0.5, configs, False)
                variants = [(name if dtype == torch.bfloat16 else "fp16, row scales", kw)]
                if dtype == torch.float16:
                    variants.append(("fp16, no row scales", dict(kw, ROW_SCALE=False)))
                for label, meta in variants:
                    fns[label] = (lambda g=grid, ts=tensors, s=scalars, m=meta, u=use_tma:
                                  triton_launch._FWD(g, ts, s, m, USE_TMA=u))
                    fns[label]()
                    outs[label] = out.float().clone()
            err = ((outs["fp16, no row scales"] - outs["fp16, row scales"]).norm() / outs["fp16, row scales"].norm())
            times = {label: [] for label in fns}
            order = list(fns.items())
            for r in range(ROUNDS):
                for label, fn in (order if r % 2 == 0 else order[::-1]):
                    times[label].append(triton.testing.do_bench(fn, warmup=10, rep=40))
            cells = [f"{statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]" for ts in times.values()]
            cfg = configs.fwd
            tiles = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (" tma" if cfg.tma else "")
            print(f"| {d} | {t} | {tiles} | " + " | ".join(cells) + f" | {err.item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
