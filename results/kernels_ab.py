"""Two (or more) versions of the package in one process: outputs and gradients against the first, then forward,
forward+backward and the fused differential op's forward+backward, interleaved, medians of 3 rounds of
`triton.testing.do_bench`, against SDPA-cuDNN. Made results/kernels_ab_2026-12-05.txt on one H200 (session 20;
lit_thresh/ops/PERF.md v15), with four copies: `old` = 4e8b659, `table` = 7531581, and `relu` and `pfold`, two
states of the working tree between them (ReLU as one max.NaN; then also the p of dS folded), which were not
committed, so the recipe below makes the old and table columns only. Each version is a copy of the package
renamed lit_thresh_<name>:

    rm -rf /tmp/ab && mkdir -p /tmp/ab
    for name in old:4e8b659 table:7531581; do
        git archive ${name#*:} lit_thresh | tar -x -C /tmp/ab && mv /tmp/ab/lit_thresh /tmp/ab/lit_thresh_${name%%:*}
        grep -rl --include=*.py lit_thresh /tmp/ab/lit_thresh_${name%%:*} | xargs sed -i \
            -e "s/\\blit_thresh\\./lit_thresh_${name%%:*}./g" -e "s/from lit_thresh import/from lit_thresh_${name%%:*} import/"
    done
    PYTHONPATH=/tmp/ab python results/kernels_ab.py kernels_ab.txt old,table

The copies keep the torch.library op names of the package (lit_thresh::...); that is harmless only because
these eager calls go through torch.autograd.Function, not through the registered custom ops.

This file is a tidied copy of the session script that made it (the same steps and output; the copy itself has not
run on a GPU)."""

import concurrent.futures
import importlib
import multiprocessing
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROUNDS = 3
CELLS = [(dtype, d, t) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128) for t in (4096, 16384)]


def warm(task: tuple[str, str, int]) -> None:
    """Worker: compile one version's kernels at (dtype, D), TMA loads on as at the timed sizes."""
    name, dtype_name, d = task
    api = importlib.import_module(f"lit_thresh_{name}.ops.api")
    importlib.import_module(f"lit_thresh_{name}.ops.triton_launch").TMA_MIN_WORK = 0
    mk = lambda: (0.5 * torch.randn(1, 16, 512, d, device="cuda", dtype=getattr(torch, dtype_name))).requires_grad_()
    q, k, v, q2, k2 = mk(), mk(), mk(), mk(), mk()
    beta = torch.ones(16, device="cuda", requires_grad=True)
    lam = torch.full((16,), 0.5, device="cuda", requires_grad=True)
    api.threshold_attention(q, k, v, beta, 2.0).sum().backward()
    with torch.no_grad():
        api.threshold_attention(q, k, v, beta, 2.0)
    api.differential_threshold_attention(q, q2, k, k2, v, beta, lam, 2.0).sum().backward()
    torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(out_path: str, names: list[str]) -> None:
    def log(line: str) -> None:
        print(line, flush=True)
        with open(out_path, "a") as f:
            f.write(line + "\n")

    ops = {name: importlib.import_module(f"lit_thresh_{name}.ops.api") for name in names}
    start = time.time()
    tasks = [(name, dtype, d) for name in names for dtype in ("bfloat16", "float16") for d in (64, 128)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=12, mp_context=context) as pool:
        list(pool.map(warm, tasks))
    print(f"warm {time.time() - start:.0f} s", flush=True)
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    bench = lambda fn, grads: triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    torch.manual_seed(0)
    for dtype, d, t in CELLS:
        b, h = 16384 // t, 16
        mk = lambda: (0.5 * torch.randn(b, h, t, d, device="cuda", dtype=dtype)).requires_grad_()
        q, k, v, q2, k2 = mk(), mk(), mk(), mk(), mk()  # (B, H, T, D) each
        beta = torch.ones(h, device="cuda", requires_grad=True)
        lam = torch.full((h,), 0.5, device="cuda", requires_grad=True)
        do = torch.randn(b, h, t, d, device="cuda", dtype=dtype)
        grads, dgrads = [q, k, v, beta], [q, q2, k, k2, v, beta, lam]
        res, dres = {}, {}
        for name, api in ops.items():
            out = api.threshold_attention(q, k, v, beta, 2.0)
            out.backward(do)
            res[name] = [out.detach()] + [x.grad.clone() for x in grads]
            for x in dgrads:
                x.grad = None
            out = api.differential_threshold_attention(q, q2, k, k2, v, beta, lam, 2.0)
            out.backward(do)
            dres[name] = [out.detach()] + [x.grad.clone() for x in dgrads]
            for x in dgrads:
                x.grad = None
        checks = [f"{name}: equal={all(torch.equal(a, c) for a, c in zip(res[name], res[names[0]]))} "
                  f"max rel {max(rel(a, c) for a, c in zip(res[name], res[names[0]])):.1e} "
                  f"diff max rel {max(rel(a, c) for a, c in zip(dres[name], dres[names[0]])):.1e}" for name in names[1:]]
        fns = {}
        for name, api in ops.items():
            fns[f"{name} fwd"] = (lambda api=api: api.threshold_attention(q, k, v, beta, 2.0), None)
            fns[f"{name} fb"] = (lambda api=api: api.threshold_attention(q, k, v, beta, 2.0).backward(do), grads)
            fns[f"{name} dfb"] = (lambda api=api: api.differential_threshold_attention(
                q, q2, k, k2, v, beta, lam, 2.0).backward(do), dgrads)

        def cudnn(backward: bool) -> None:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                if backward:
                    out.backward(do)

        fns["cudnn fwd"] = (lambda: cudnn(False), None)
        fns["cudnn fb"] = (lambda: cudnn(True), grads)
        times = {key: [] for key in fns}
        for _ in range(ROUNDS):
            for key, (fn, g) in fns.items():
                if g is None:
                    with torch.no_grad():
                        times[key].append(bench(fn, None))
                else:
                    times[key].append(bench(fn, g))
        med = {key: statistics.median(x) for key, x in times.items()}
        spread = {key: 100 * (max(x) - min(x)) / statistics.median(x) for key, x in times.items()}
        log(f"{str(dtype)[6:]} D={d} T={t} B={b}: " + "; ".join(checks))
        for kind in ("fwd", "fb", "dfb"):
            parts = []
            for name in names:
                key = f"{name} {kind}"
                part = f"{name} {med[key]:.3f} ms ({spread[key]:.1f}%)"
                if name != names[0]:
                    part += f" /{names[0]} {med[key] / med[f'{names[0]} {kind}']:.3f}"
                part += (f" two/fused {2 * med[f'{name} fb'] / med[key]:.2f}" if kind == "dfb"
                         else f" xcudnn {med[f'cudnn {kind}'] / med[key]:.2f}")
                parts.append(part)
            cud = "" if kind == "dfb" else f" | cudnn {med[f'cudnn {kind}']:.3f} ({spread[f'cudnn {kind}']:.1f}%)"
            log(f"   {kind:4s}: " + " | ".join(parts) + cud)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
