"""Time threshold attention against PyTorch SDPA (and optionally the seed kernel) on a CUDA device.

    python -m lit_thresh.bench                       # (4, 16, 2048, 64) bf16, forward and forward+backward
    python -m lit_thresh.bench --seq-lens 1024 4096 --dtype float16 --seed-path path/to/seed.py
    python -m lit_thresh.bench --sweep               # also try block configs of each kernel

Times are medians of triton.testing.do_bench; the table gives each variant's time over SDPA's.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lit_thresh.ops import differential_threshold_rela_triton, threshold_attention

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _median_ms(fn: Callable[[], object], grads: list[torch.Tensor]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def _load_seed(path: str):
    spec = importlib.util.spec_from_file_location("seed_threshold_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variants(seed_path: str | None) -> dict[str, Callable]:
    """name -> f(q, k, v) returning (B, H, T, D)."""
    variants = {
        "sdpa (causal softmax)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "threshold p=2": lambda q, k, v: threshold_attention(q, k, v, 1.0, 2.0),
        "threshold p=1": lambda q, k, v: threshold_attention(q, k, v, 1.0, 1.0),
        "threshold p=1.5": lambda q, k, v: threshold_attention(q, k, v, 1.0, 1.5),
        "differential p=2": lambda q, k, v: differential_threshold_rela_triton(q, k, q, k, v, 1.0, 0.5),
    }
    if seed_path:
        seed = _load_seed(seed_path)
        variants["seed p=2"] = lambda q, k, v: seed.threshold_rela_triton(q, k, v, torch.tensor(1.0), 2.0)
    return variants


def _inputs(b: int, h: int, t: int, d: int, dtype: torch.dtype):
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=dtype) * 0.5 for _ in range(3))
    return [x.requires_grad_() for x in (q, k, v)], torch.randn(b, h, t, d, device="cuda", dtype=dtype)


def run_table(b: int, h: int, seq_lens: list[int], d: int, dtype: torch.dtype, seed_path: str | None) -> None:
    rows = []
    for t in seq_lens:
        (q, k, v), dout = _inputs(b, h, t, d, dtype)
        for name, fn in _variants(seed_path).items():
            fwd = _median_ms(lambda: fn(q, k, v), [q, k, v])
            out = fn(q, k, v)
            both = _median_ms(lambda: fn(q, k, v).backward(dout), [q, k, v])
            rows.append((t, name, fwd, both))
            del out
    print(f"\n(B, H, D) = ({b}, {h}, {d}), {dtype}, median ms (x = time / SDPA's)")
    print(f"{'T':>6} {'variant':<24} {'fwd ms':>8} {'x':>6} {'fwd+bwd ms':>11} {'x':>6}")
    base = {t: (f, fb) for t, name, f, fb in rows if name.startswith("sdpa")}
    for t, name, f, fb in rows:
        print(f"{t:>6} {name:<24} {f:8.3f} {f / base[t][0]:6.2f} {fb:11.3f} {fb / base[t][1]:6.2f}")


def sweep(b: int, h: int, t: int, d: int, dtype: torch.dtype) -> None:
    """Time each kernel alone over block configs; print the best few per kernel."""
    from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs, default_configs, triton_backward, triton_forward

    (q, k, v), dout = _inputs(b, h, t, d, dtype)
    beta = torch.ones(h, device="cuda")
    default = default_configs(d, dtype)
    tiles = {"fwd": [(128, 64), (128, 32), (64, 64), (128, 128)], "bwd_dkv": [(32, 128), (64, 64), (64, 128), (32, 64)],
             "bwd_dq": [(128, 32), (64, 64), (128, 64), (64, 32)]}
    for kernel in ("fwd", "bwd_dkv", "bwd_dq"):
        results = []
        for (m, n), w, s in itertools.product(tiles[kernel], (4, 8), (2, 3)):
            cfg = BlockConfig(m, n, w, s)
            configs = KernelConfigs(**{**default.__dict__, kernel: cfg})
            if kernel == "fwd":
                fn = lambda: triton_forward(q, k, v, beta, 2.0, 1.0, configs)  # noqa: E731
            else:
                fn = lambda: triton_backward(q, k, v, beta, 2.0, 1.0, dout, False, configs)  # noqa: E731
            try:
                results.append((_median_ms(fn, []), cfg))
            except Exception as err:  # out of shared memory or registers for this tile: skip it
                results.append((float("inf"), f"{cfg} failed: {type(err).__name__}"))
        results.sort(key=lambda r: r[0])
        print(f"\n{kernel} (T={t}, D={d}, {dtype}): default {getattr(default, kernel)}")
        for ms, cfg in results[:5]:
            print(f"  {ms:8.3f} ms  {cfg}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed-path", help="path of the seed's triton_threshold_attention.py, to time it too")
    parser.add_argument("--sweep", action="store_true", help="also time block configs of each kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the benchmark needs a CUDA device")
    dtype = DTYPES[args.dtype]
    if args.sweep:
        sweep(args.batch, args.heads, args.seq_lens[0], args.head_dim, dtype)
    run_table(args.batch, args.heads, args.seq_lens, args.head_dim, dtype, args.seed_path)


if __name__ == "__main__":
    main()
