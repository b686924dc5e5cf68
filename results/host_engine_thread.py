"""Host time of eager calls in two (or more) versions of the package, and where a small forward+backward's
host time goes on the autograd engine's thread. Tiny (1, 2, 128, 64) bf16 inputs (kernel time is far below
the host's), (H,) beta, no synchronisation in the loops, the cases interleaved: median [min - max] over 7
loops of 300 calls, in us (bench._host_us).

1. Per version: the forward with no grad, the forward+backward with the engine multi- and single-threaded
   (torch.autograd.set_multithreading_enabled), triton_backward called directly.
2. Stamps (time.perf_counter_ns) around the first version's backward body and a do-nothing
   autograd.Function's: from `.backward()` to the body, the body, from the body back to the caller; medians
   over 300 calls, engine multi- and single-threaded.
3. The same stamps with every thread of the process pinned to one core, then to two.

Each version is a copy of the package renamed lit_thresh_<name> (the recipe of results/kernels_ab.py).
host_engine_thread_2026-12-06_h100.txt was made on one H100 (session 25; lit_thresh/ops/PERF.md v19) with
main = cabab49 and direct = e47809b (FastLaunch's launches without Triton's runner):

    rm -rf /tmp/ab && mkdir -p /tmp/ab
    for name in main:cabab49 direct:e47809b; do
        git archive ${name#*:} lit_thresh | tar -x -C /tmp/ab && mv /tmp/ab/lit_thresh /tmp/ab/lit_thresh_${name%%:*}
        grep -rl --include=*.py lit_thresh /tmp/ab/lit_thresh_${name%%:*} | xargs sed -i \\
            -e "s/\\\\blit_thresh\\\\./lit_thresh_${name%%:*}./g" -e "s/from lit_thresh import/from lit_thresh_${name%%:*} import/"
    done
    PYTHONPATH=/tmp/ab python results/host_engine_thread.py main,direct
"""

import importlib
import os
import statistics
import sys
import time

import torch

from lit_thresh.bench import _host_us

N, ROUNDS = 300, 7


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):8.1f} [{min(times):.1f} - {max(times):.1f}]"


def pin(cores: set[int]) -> None:
    """Every thread of this process (the autograd engine's included) onto `cores`."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)


class Stamps:
    """perf_counter_ns at the call, at the backward body's start and end, and at the return."""

    def __init__(self) -> None:
        self.body_start = self.body_end = 0
        self.rows: list[tuple[int, int, int]] = []

    def wrap(self, backward):
        def stamped(ctx, *grads):
            self.body_start = time.perf_counter_ns()
            try:
                return backward(ctx, *grads)
            finally:
                self.body_end = time.perf_counter_ns()
        return stamped

    def measure(self, fn, calls: int) -> tuple[float, float, float]:
        """Medians in us of (call -> body, body, body -> return) over `calls` calls after 20 unmeasured."""
        self.rows = []
        for i in range(calls + 20):
            start = time.perf_counter_ns()
            fn()
            end = time.perf_counter_ns()
            if i >= 20:
                self.rows.append((self.body_start - start, self.body_end - self.body_start, end - self.body_end))
        torch.cuda.synchronize()
        return tuple(statistics.median(r[i] for r in self.rows) / 1e3 for i in range(3))


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    mk = lambda: 0.5 * torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)  # (B, H, T, D)
    q, k, v = (mk().requires_grad_() for _ in range(3))
    qd, kd, vd, dout = q.detach(), k.detach(), v.detach(), mk()
    beta = torch.full((2,), 0.5, device="cuda", requires_grad=True)
    beta_d = beta.detach()
    mods = {name: importlib.import_module(f"lit_thresh_{name}.ops") for name in names}
    launch = {name: importlib.import_module(f"lit_thresh_{name}.ops.triton_launch") for name in names}

    ref = mods[names[0]].threshold_attention(q, k, v, beta, 2.0)
    grads_ref = torch.autograd.grad(ref, (q, k, v, beta), dout)
    for name, ops in mods.items():
        out = ops.threshold_attention(q, k, v, beta, 2.0)
        grads = torch.autograd.grad(out, (q, k, v, beta), dout)
        same = torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
        print(f"{name}: output and gradients equal to {names[0]}'s: {same}", flush=True)

    cases = {}
    for name, ops in mods.items():
        attn, tb = ops.threshold_attention, launch[name].triton_backward
        cases[f"{name} fwd no grad"] = (False, lambda attn=attn: attn(qd, kd, vd, beta_d, 2.0))
        cases[f"{name} fwd+bwd"] = (False, lambda attn=attn: attn(q, k, v, beta, 2.0).backward(dout))
        cases[f"{name} fwd+bwd [engine single-threaded]"] = (
            True, lambda attn=attn: attn(q, k, v, beta, 2.0).backward(dout))
        cases[f"{name} triton_backward direct (dbeta)"] = (
            False, lambda tb=tb: tb(qd, kd, vd, beta_d, 2.0, 1.0, dout, True))
    times = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, (single, fn) in cases.items():
            with torch.autograd.set_multithreading_enabled(not single):
                times[name].append(_host_us(fn, N, warmup=10))
    print(f"\n1. {torch.cuda.get_device_name()}: host us per call, median [min - max] of {ROUNDS} loops of {N}")
    for name, t in times.items():
        print(f"  {name:50s} {spread(t)}")
    for name in names[1:]:
        for case in ("fwd no grad", "fwd+bwd", "fwd+bwd [engine single-threaded]", "triton_backward direct (dbeta)"):
            ratio = statistics.median(times[f"{name} {case}"]) / statistics.median(times[f"{names[0]} {case}"])
            print(f"  {name} / {names[0]}, {case}: {ratio:.3f}")

    stamps = Stamps()
    fn_cls = importlib.import_module(f"lit_thresh_{names[0]}.ops.function")._EagerThresholdAttention
    fn_cls.backward = staticmethod(stamps.wrap(fn_cls.backward))

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, beta):
            return q.clone()

        @staticmethod
        def backward(ctx, g):
            return g, g, g, None

    Ident.backward = staticmethod(stamps.wrap(Ident.backward))
    attn = mods[names[0]].threshold_attention
    runs = {"ours": lambda: attn(q, k, v, beta, 2.0).backward(dout),
            "Ident": lambda: Ident.apply(q, k, v, beta).backward(dout)}
    all_cores = os.sched_getaffinity(0)
    first = sorted(all_cores)[1]
    for label, cores in (("all cores", all_cores), ("one core", {first}), ("two cores", {first, first + 1})):
        pin(cores)
        print(f"\n{'2' if label == 'all cores' else '3'}. {label} ({len(cores)}): us, median of {N} calls: "
              "call -> backward body | body | body -> return")
        for _ in range(2):  # two rounds, to see the spread
            for run, fn in runs.items():
                for single in (False, True):
                    with torch.autograd.set_multithreading_enabled(not single):
                        to_body, body, back = stamps.measure(fn, N)
                    engine = "single-threaded" if single else "multi-threaded "
                    print(f"  {run:6s} engine {engine}: {to_body:7.1f} | {body:7.1f} | {back:7.1f}"
                          f"  (all {to_body + body + back:.1f})")
    pin(all_cores)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
