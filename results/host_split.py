"""Where an eager call's host time goes: the op, its layers called one by one, SDPA, and a do-nothing
autograd.Function, with the autograd engine multi- and single-threaded, then a cProfile of the op's forward +
backward on the calling thread. Tiny (1, 2, 128, 64) bf16 inputs (kernel time is far below the host's), (H,)
beta, no synchronisation in the loops, the cases interleaved: median [min - max] over 7 loops of 300 calls,
in us. Made host_split_2026-12-06_h100.txt on one H100 (session 24; lit_thresh/ops/PERF.md v18) at 6be0b81
(with an fp16-only kernel change beside it, not committed, that these bf16 calls do not reach):

    python results/host_split.py

This file is a tidied copy of the session script that made it (the same calls and output; the copy itself
has not run on a GPU). It reads FastLaunch's internals as they were at 6be0b81."""
import cProfile
import io
import pstats
import statistics

import torch
import torch.nn.functional as F

from lit_thresh.bench import _host_us
from lit_thresh.ops import threshold_attention
from lit_thresh.ops.fast_launch import FastLaunch
from lit_thresh.ops.triton_launch import triton_backward, triton_forward

N, ROUNDS = 300, 7
torch.manual_seed(0)
mk = lambda: (0.5 * torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16))
q, k, v = (mk().requires_grad_() for _ in range(3))
qd, kd, vd = q.detach(), k.detach(), v.detach()
beta = torch.full((2,), 0.5, device="cuda", requires_grad=True)
beta_buf = torch.full((2,), 0.5, device="cuda")
dout = mk()
dbeta_const = torch.zeros(2, device="cuda")


class Ident(torch.autograd.Function):
    """Does next to nothing: what remains is the engine, a Python node and the four gradients' accumulation."""

    @staticmethod
    def forward(ctx, q, k, v, beta):
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, g, g, dbeta_const


class IdentSave(torch.autograd.Function):
    """Ident that also saves q, k, v and beta and allocates its four gradients (as ours does)."""

    @staticmethod
    def forward(ctx, q, k, v, beta):
        ctx.save_for_backward(q, k, v, beta)
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        q, k, v, beta = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)


# one forward launch's arguments, captured to launch it again by each path
captured = {}
orig_run = FastLaunch.run
orig_call = FastLaunch.__call__


def spy_call(self, grid, tensors, scalars, constexprs, **flags):
    captured.setdefault(str(id(self)), (self, grid, tensors, scalars, constexprs, flags))
    return orig_call(self, grid, tensors, scalars, constexprs, **flags)


def spy_run(compiled, grid, args, tail):
    captured.setdefault("run", (compiled, grid, args, tail))
    return orig_run(compiled, grid, args, tail)


for _ in range(3):
    threshold_attention(q, k, v, beta, 2.0).backward(dout)
FastLaunch.__call__ = spy_call
FastLaunch.run = staticmethod(spy_run)
with torch.no_grad():
    threshold_attention(qd, kd, vd, beta_buf, 2.0)
FastLaunch.__call__ = orig_call
FastLaunch.run = staticmethod(orig_run)
(fl, fgrid, ftensors, fscalars, fconst, fflags) = next(x for key, x in captured.items() if key != "run")
compiled, rgrid, rargs, rtail = captured["run"]
g3 = (rgrid + (1, 1))[:3]


def raw():
    compiled.run(g3[0], g3[1], g3[2], torch._C._cuda_getCurrentRawStream(0), compiled.function,
                 compiled.packed_metadata, None, None, None, *rargs, *rtail)


# the launcher called directly writes the op's output
out_ref = threshold_attention(qd, kd, vd, beta_buf, 2.0)
outbuf = rargs[3]
outbuf.zero_()
raw()
torch.cuda.synchronize()
print("raw launch equals op:", torch.equal(outbuf, out_ref), flush=True)

dbeta_rows = torch.randn(2, 128, device="cuda")
cases = {
    "ours fwd no grad ((H,) beta)": lambda: threshold_attention(qd, kd, vd, beta_buf, 2.0),
    "ours fwd with grad (graph dropped)": lambda: threshold_attention(q, k, v, beta, 2.0),
    "ours fwd+bwd": lambda: threshold_attention(q, k, v, beta, 2.0).backward(dout),
    "sdpa fwd no grad": lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True),
    "sdpa fwd+bwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout),
    "Ident fwd+bwd (engine + Python node + 4 accumulates)": lambda: Ident.apply(q, k, v, beta).backward(dout),
    "IdentSave fwd+bwd (+ saves, 4 empties)": lambda: IdentSave.apply(q, k, v, beta).backward(dout),
    "triton_forward direct": lambda: triton_forward(qd, kd, vd, beta_buf, 2.0, 1.0),
    "triton_backward direct (dbeta)": lambda: triton_backward(qd, kd, vd, beta_buf, 2.0, 1.0, dout, True),
    "triton_backward direct (no dbeta)": lambda: triton_backward(qd, kd, vd, beta_buf, 2.0, 1.0, dout, False),
    "FastLaunch fwd launch (key + run)": lambda: fl(fgrid, ftensors, fscalars, fconst, **fflags),
    "FastLaunch.run (compiled[grid](...))": lambda: orig_run(compiled, rgrid, rargs, rtail),
    "compiled.run raw (C launcher direct)": raw,
    "torch.empty_like(q)": lambda: torch.empty_like(qd),
    "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    "dbeta sum": lambda: dbeta_rows.view(1, 2, 128).sum(dim=(0, 2)),
}
single_thread = {"ours fwd+bwd [engine single-threaded]": cases["ours fwd+bwd"],
                 "sdpa fwd+bwd [engine single-threaded]": cases["sdpa fwd+bwd"],
                 "Ident fwd+bwd [engine single-threaded]": cases["Ident fwd+bwd (engine + Python node + 4 accumulates)"]}


times = {name: [] for name in list(cases) + list(single_thread)}
for _ in range(ROUNDS):
    for name, fn in cases.items():
        times[name].append(_host_us(fn, N, warmup=10))
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in single_thread.items():
            times[name].append(_host_us(fn, N, warmup=10))
print(f"{torch.cuda.get_device_name()}: host us per call, median [min - max] of {ROUNDS} loops of {N}")
for name, t in times.items():
    print(f"  {name:58s} {statistics.median(t):8.1f} [{min(t):.1f} - {max(t):.1f}]")

with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread, where cProfile sees it
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        threshold_attention(q, k, v, beta, 2.0).backward(dout)
    pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
print("cProfile, 500 fwd+bwd, engine single-threaded:\n" + "\n".join(s.getvalue().splitlines()[:60]))
