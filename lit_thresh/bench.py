"""Time threshold attention against PyTorch SDPA (cuDNN and flash backends) on a CUDA device.

    python -m lit_thresh.bench                                   # the whole grid, one table
    python -m lit_thresh.bench --head-dims 128 --seq-lens 4096 --dtypes bfloat16 --quick
    python -m lit_thresh.bench --repeats 3 ...                   # medians and spreads over 3 rounds
    python -m lit_thresh.bench --sweep --no-table --csv sweep.csv  # block configs of each kernel, single
                                                                   # and differential op

Grid: head dim D x sequence length T x dtype, B = tokens / T sequences of H heads, causal. Columns, for
forward and forward+backward: median ms (triton.testing.do_bench; with --repeats, the median over rounds of
every row of a grid point, interleaved, and the rounds' spread, (max - min) / median), TFLOP/s of causal
attention (forward 2 B H T^2 D, backward 2.5x forward; the differential op counts two maps), `x cudnn` /
`x flash` = the SDPA backend's time over this row's (above 1: faster than SDPA), and peak extra memory (MiB,
outputs and gradients included). Rows: SDPA; the single op (beta learnable, so dbeta is computed); the
differential op fused (when lit_thresh.ops has it) and as two single calls; and rows on sparse maps:
unit-norm q, k drawn around one direction per 512-position segment, beta set so that a measured 50 / 90 /
99% of the causal weights are zero (`--zero-fractions`; 0 gives a dense map, where skipping can only cost),
launched with skip_zero off and on (the measured zero fraction of weights and of 64x64 tiles is printed).
Host overhead: host time per call on tiny inputs, with no synchronisation in the loop, and again with the
op's Triton launches stubbed out (our Python alone; the difference is Triton's launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing import get_context

import torch
import torch.nn.functional as F

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA_VARIANTS = ("sdpa cudnn", "sdpa flash")
SEGMENT = 512  # positions sharing one direction in the sparse-map inputs
TILE = 64  # tile edge for the measured all-zero tile fraction


@dataclass
class Result:
    """One timed variant at one grid point; times in ms, memory in MiB; NaN where not measured."""

    variant: str
    dtype: str
    head_dim: int
    seq_len: int
    batch: int
    heads: int
    fwd_ms: float = math.nan
    fwd_bwd_ms: float = math.nan
    fwd_mib: float = math.nan
    fwd_bwd_mib: float = math.nan
    fwd_spread: float = math.nan  # (max - min) / median of fwd_ms over --repeats rounds
    fwd_bwd_spread: float = math.nan
    maps: int = 1  # attention maps computed (2 for the differential op), for the FLOP count
    note: str = ""


@dataclass
class HostResult:
    """Host time per call, no synchronisation between calls: the median over repeated loops, and their range."""

    variant: str
    host_us: float
    host_us_min: float = math.nan
    host_us_max: float = math.nan


@dataclass
class Timing:
    """How long do_bench measures: milliseconds of warm-up and of repeats."""

    warmup: int = 25
    rep: int = 100


def causal_fwd_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """Two (T x T x D) products, half of them under the causal mask."""
    return 2.0 * batch * heads * seq_len * seq_len * head_dim


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def derived(results: Sequence[Result]) -> list[dict]:
    """Each result as a dict with TFLOP/s and the time ratios against SDPA cuDNN and flash added."""
    base = {(r.dtype, r.head_dim, r.seq_len, r.variant): r for r in results if r.variant in SDPA_VARIANTS}
    rows = []
    for r in results:
        flops = r.maps * causal_fwd_flops(r.batch, r.heads, r.seq_len, r.head_dim)
        row = asdict(r)
        row["fwd_tflops"] = _tflops(flops, r.fwd_ms)
        row["fwd_bwd_tflops"] = _tflops(3.5 * flops, r.fwd_bwd_ms)
        for name in SDPA_VARIANTS:
            ref = base.get((r.dtype, r.head_dim, r.seq_len, name))
            tag = name.split()[1]
            row[f"fwd_x_{tag}"] = ref.fwd_ms / r.fwd_ms if ref else math.nan
            row[f"fwd_bwd_x_{tag}"] = ref.fwd_bwd_ms / r.fwd_bwd_ms if ref else math.nan
        rows.append(row)
    return rows


COLUMNS = [  # (key, header, format)
    ("dtype", "dtype", "{:<8}"), ("head_dim", "D", "{:>4}"), ("seq_len", "T", "{:>6}"), ("batch", "B", "{:>3}"),
    ("variant", "variant", "{:<30}"),
    ("fwd_ms", "fwd ms", "{:>8.3f}"), ("fwd_spread", "spread", "{:>6.1%}"), ("fwd_tflops", "TFLOP/s", "{:>8.1f}"),
    ("fwd_x_cudnn", "x cudnn", "{:>7.2f}"),
    ("fwd_x_flash", "x flash", "{:>7.2f}"), ("fwd_mib", "MiB", "{:>7.0f}"),
    ("fwd_bwd_ms", "f+b ms", "{:>8.3f}"), ("fwd_bwd_spread", "spread", "{:>6.1%}"),
    ("fwd_bwd_tflops", "TFLOP/s", "{:>8.1f}"),
    ("fwd_bwd_x_cudnn", "x cudnn", "{:>7.2f}"), ("fwd_bwd_x_flash", "x flash", "{:>7.2f}"), ("fwd_bwd_mib", "MiB", "{:>7.0f}"),
    ("note", "note", "{}"),
]


def _cell(fmt: str, value) -> str:
    """value in fmt; '-' in the column's width for NaN (not measured)."""
    if isinstance(value, float) and not math.isfinite(value):
        return _header_fmt(fmt).format("-")
    return fmt.format(value)


def _header_fmt(fmt: str) -> str:
    """A number's format without its precision, for strings: '{:>8.3f}' -> '{:>8}', '{:>6.1%}' -> '{:>6}'."""
    return re.sub(r"\.\d+[f%]", "", fmt)


def format_table(results: Sequence[Result]) -> str:
    """The results as one fixed-width table (one line per result)."""
    lines = [" ".join(_header_fmt(fmt).format(name) for _, name, fmt in COLUMNS).rstrip()]
    for row in derived(results):
        lines.append(" ".join(_cell(fmt, row[key]) for key, _, fmt in COLUMNS).rstrip())
    return "\n".join(lines)


def format_host(results: Sequence[HostResult]) -> str:
    lines = ["host time per call (us), no synchronisation: median [min - max] over repeated loops"]
    return "\n".join(lines + [f"  {r.variant:<66} {r.host_us:8.1f} [{r.host_us_min:.1f} - {r.host_us_max:.1f}]"
                              for r in results])


def write_csv(path: str, results: Sequence[Result], host: Sequence[HostResult] = ()) -> None:
    """One CSV line per result (derived columns included), then one per host-overhead measurement."""
    host_keys = ["host_us", "host_us_min", "host_us_max"]
    rows = derived(results) + [{"variant": h.variant, **{k: getattr(h, k) for k in host_keys}} for h in host]
    keys = [f.name for f in fields(Result)] + [k for k, _, _ in COLUMNS if k not in {f.name for f in fields(Result)}]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + host_keys, restval="")
        writer.writeheader()
        writer.writerows(rows)


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """The median of repeated timings and their spread, (max - min) / median; NaN where undefined (no
    timing; a spread needs two)."""
    if not times:
        return math.nan, math.nan
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median if len(times) > 1 else math.nan


def combine_rounds(rounds: Sequence[Sequence[Result]]) -> list[Result]:
    """One result per row of repeated rounds of the same rows: the median time over the rounds that
    measured it, its spread ((max - min) / median, where two or more did), the largest memory, and the
    first failure's note, if a round failed."""
    out = []
    for rows in zip(*rounds, strict=True):
        first = rows[0]
        if len({(r.variant, r.dtype, r.head_dim, r.seq_len, r.batch) for r in rows}) != 1:
            raise ValueError(f"rounds must time the same rows in the same order, got {[r.variant for r in rows]}")
        combined = replace(first, note=next((r.note for r in rows if r.note.startswith("failed")), first.note))
        for key in ("fwd", "fwd_bwd"):
            median, spread = median_spread([t for t in (getattr(r, f"{key}_ms") for r in rows) if math.isfinite(t)])
            setattr(combined, f"{key}_ms", median)
            setattr(combined, f"{key}_spread", spread)
            mib = [m for m in (getattr(r, f"{key}_mib") for r in rows) if math.isfinite(m)]
            setattr(combined, f"{key}_mib", max(mib) if mib else math.nan)
        out.append(combined)
    return out


# ----------------------------------------------------------------------------------------- measuring (CUDA)


def _median_ms(fn: Callable[[], object], grads: list[torch.Tensor], timing: Timing) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=timing.warmup, rep=timing.rep, grad_to_none=grads, return_mode="median")


def _peak_extra_mib(fn: Callable[[], object], grads: list[torch.Tensor]) -> float:
    """Peak memory above what was allocated before one call (outputs and gradients included)."""
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in grads:
        t.grad = None
    return peak / 2**20


def _measure(result: Result, fwd: Callable, fwd_bwd: Callable, grads: list[torch.Tensor], timing: Timing) -> Result:
    try:
        result.fwd_mib = _peak_extra_mib(fwd, grads)
        result.fwd_ms = _median_ms(fwd, grads, timing)
        result.fwd_bwd_mib = _peak_extra_mib(fwd_bwd, grads)
        result.fwd_bwd_ms = _median_ms(fwd_bwd, grads, timing)
    except Exception as err:  # e.g. an SDPA backend that does not support this case: noted in the row
        result.note = f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:80]}"
    return result


def _randn(*shape: int, dtype: torch.dtype, scale: float = 0.5, device: str = "cuda") -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype) * scale


def grid_point(dtype: torch.dtype, d: int, t: int, b: int, h: int, timing: Timing) -> list[Result]:
    """SDPA (cuDNN, flash), the single op and the differential op at one (dtype, D, T)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lit_thresh.ops import threshold_attention

    q, k, v, q2, k2 = (_randn(b, h, t, d, dtype=dtype).requires_grad_() for _ in range(5))
    beta = torch.full((h,), 0.5, device="cuda", requires_grad=True)
    lam = torch.full((h,), 0.3, device="cuda", requires_grad=True)
    dout = _randn(b, h, t, d, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    out = []

    def add(variant: str, fn: Callable[[], torch.Tensor], grads: list[torch.Tensor], maps: int = 1) -> None:
        res = Result(variant, name, d, t, b, h, maps=maps)
        out.append(_measure(res, fn, lambda: fn().backward(dout), grads, timing))

    for variant, backend in zip(SDPA_VARIANTS, (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        add(variant, sdpa, [q, k, v])
    add("threshold p=2", lambda: threshold_attention(q, k, v, beta, 2.0), [q, k, v, beta])
    fused = _differential_op()
    if fused is not None:
        add("differential fused p=2", lambda: fused(q, q2, k, k2, v, beta, lam, 2.0), [q, q2, k, k2, v, beta, lam], 2)
    two_calls = lambda: threshold_attention(q, k, v, beta, 2.0) - lam[:, None, None] * threshold_attention(q2, k2, v, beta, 2.0)  # noqa: E731
    add("differential 2 calls p=2", two_calls, [q, q2, k, k2, v, beta, lam], 2)
    return out


def _differential_op() -> Callable | None:
    """The fused differential op, when this version of lit_thresh.ops has it."""
    import lit_thresh.ops

    return getattr(lit_thresh.ops, "differential_threshold_attention", None)


def sparse_inputs(b: int, h: int, t: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Unit-norm q, k around one random direction per SEGMENT positions (so zeros come in tiles), and v."""
    centres = F.normalize(torch.randn(b, h, -(-t // SEGMENT), d, device="cuda"), dim=-1)
    centres = centres.repeat_interleave(SEGMENT, dim=2)[:, :, :t]  # (B, H, T, D)
    q, k = (F.normalize(centres + torch.randn(b, h, t, d, device="cuda") / math.sqrt(d), dim=-1) for _ in range(2))
    return q.to(dtype), k.to(dtype), _randn(b, h, t, d, dtype=dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, beta: float, rows: torch.Tensor) -> torch.Tensor:
    """Causal scores x = q.k - beta * gain of the given query rows of one head, -inf on future keys. (R, T)"""
    t, d = k.shape
    gain = torch.sqrt(2.0 * torch.log1p(rows.float()) / d)  # (R,)
    x = q[rows].float() @ k.float().T - beta * gain[:, None]
    return x.masked_fill(torch.arange(t, device=x.device)[None, :] > rows[:, None], -math.inf)


def beta_for_zero_fraction(q: torch.Tensor, k: torch.Tensor, target: float) -> float:
    """The beta at which `target` of the causal weights of head (0, 0) are zero, by bisection on sampled rows.
    For 0 (unit-norm q and k, so scores >= -1): -1 / gain(position 1), the largest beta that keeps every weight
    past the first position > 0, so the weights stay moderate (<= (1 + sqrt(log2 T))^2)."""
    if target == 0.0:
        return -1.0 / math.sqrt(2.0 * math.log(2.0) / q.shape[-1])
    t = q.shape[2]
    rows = torch.arange(0, t, max(1, t // 512), device=q.device)
    x = _scores(q[0, 0], k[0, 0], 0.0, rows)
    gain = torch.sqrt(2.0 * torch.log1p(rows.float()) / q.shape[-1])[:, None]
    causal = x > -math.inf
    lo, hi = -50.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        zero = ((x - mid * gain <= 0) & causal).sum() / causal.sum()
        lo, hi = (lo, mid) if zero.item() >= target else (mid, hi)
    return hi


def zero_fractions(q: torch.Tensor, k: torch.Tensor, beta: float) -> tuple[float, float]:
    """Measured fraction of zero causal weights, and of all-zero causal TILE x TILE tiles, over head (0, 0)."""
    t = q.shape[2]
    zero = causal = tiles_zero = tiles = 0
    for r0 in range(0, t, TILE * 16):
        rows = torch.arange(r0, min(r0 + TILE * 16, t), device=q.device)
        x = _scores(q[0, 0], k[0, 0], beta, rows)  # (R, T)
        live = x > 0
        zero += (x > -math.inf).sum().item() - live.sum().item()
        causal += (x > -math.inf).sum().item()
        n_r, n_c = -(-len(rows) // TILE), -(-t // TILE)
        padded = F.pad(live.float(), (0, n_c * TILE - t, 0, n_r * TILE - len(rows)))  # (n_r * TILE, n_c * TILE)
        tile_live = padded.view(n_r, TILE, n_c, TILE).amax(dim=(1, 3)) > 0  # (n_r, n_c)
        first = torch.arange(n_r, device=q.device)[:, None] * TILE + r0  # first row of each tile row
        tile_causal = torch.arange(n_c, device=q.device)[None, :] * TILE <= first + TILE - 1
        tiles += tile_causal.sum().item()
        tiles_zero += (tile_causal & ~tile_live).sum().item()
    return zero / causal, tiles_zero / tiles


def sparse_rows(dtype: torch.dtype, d: int, t: int, b: int, h: int, fractions: Iterable[float], timing: Timing) -> list[Result]:
    """The launchers with skip_zero off and on, on maps with a measured fraction of zero weights."""
    from lit_thresh.ops.triton_launch import default_configs, triton_backward, triton_forward

    q, k, v = sparse_inputs(b, h, t, d, dtype)
    dout = _randn(b, h, t, d, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    base = default_configs(d, dtype, t)
    out = []
    for target in fractions:
        beta_value = beta_for_zero_fraction(q, k, target)
        weights_zero, tiles_zero = zero_fractions(q, k, beta_value)
        beta = torch.full((h,), beta_value, device="cuda")
        for skip in (False, True):
            cfgs = type(base)(*(replace(c, skip_zero=skip) for c in (base.fwd, base.bwd_dkv, base.bwd_dq)))
            fwd = lambda cfgs=cfgs: triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)  # noqa: E731

            def fwd_bwd(cfgs=cfgs):  # the backward skips by the forward's map, as in training
                live = triton_forward(q, k, v, beta, 2.0, 1.0, cfgs)[1]
                return triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, cfgs, live=live)

            res = Result(f"zeros {target:.0%} skip {'on' if skip else 'off'}", name, d, t, b, h,
                         note=f"measured: {weights_zero:.1%} of weights, {tiles_zero:.1%} of {TILE}x{TILE} tiles zero")
            out.append(_measure(res, fwd, fwd_bwd, [], timing))
    return out


class _NoLaunch:
    """Stands in for a Triton kernel (its parameters): `kernel[grid](...)` returns a compiled kernel whose
    launches do nothing."""

    def __init__(self, kernel) -> None:
        self.params = getattr(kernel, "params", ())  # as FastLaunch reads them (not under the interpreter)

    def __getitem__(self, grid):
        return _no_launch


class _NoLaunchCompiled:
    """Stands in for a CompiledKernel: what fast_launch.launch reads, and a `run` that does nothing."""

    function = packed_metadata = None

    def launch_metadata(self, *args) -> None:
        return None

    def run(self, *args) -> None:
        return None


_NO_LAUNCH_COMPILED = _NoLaunchCompiled()


def _no_launch(*args, **kwargs) -> _NoLaunchCompiled:
    return _NO_LAUNCH_COMPILED


@contextlib.contextmanager
def _swapped_launches(make: Callable[[object], object]):
    """The single op's three launchers replaced by make(kernel) for the duration, with call plans of their
    own (lit_thresh/ops/call_plans.py: a plan's prepared forward holds the compiled kernel it launches)."""
    from lit_thresh.ops import call_plans, triton_launch

    names = ("_FWD", "_BWD_DKV", "_BWD_DQ")
    saved = {name: getattr(triton_launch, name) for name in names}
    saved_plans, call_plans._PLANS = call_plans._PLANS, {}
    for name in names:
        setattr(triton_launch, name, make(saved[name].kernel))
    try:
        yield
    finally:
        for name, launcher in saved.items():
            setattr(triton_launch, name, launcher)
        call_plans._PLANS = saved_plans


def stubbed_launches():
    """The single op's Triton launches replaced by no-ops (its outputs are left unwritten): FastLaunch keeps
    a compiled kernel whose `run` does nothing, so what remains of a call's host time is our Python and the
    torch ops around the kernels, planned calls' prepared forward included, not Triton's launcher."""
    from lit_thresh.ops.fast_launch import FastLaunch

    return _swapped_launches(lambda kernel: FastLaunch(_NoLaunch(kernel)))


def triton_path_launches():
    """The single op's launches through Triton's own argument binding at every call (no FastLaunch)."""
    from lit_thresh.ops.fast_launch import FastLaunch

    class TritonPath(FastLaunch):
        def __call__(self, grid, tensors, scalars, constexprs, **flags) -> None:
            self.kernel[grid](*tensors, *scalars, **constexprs, **flags)

    return _swapped_launches(TritonPath)


def _host_us(fn: Callable[[], object], calls: int, warmup: int = 20) -> float:
    """Host time per call after `warmup` calls, the loop never synchronising: on tiny inputs the GPU keeps
    up, so this is the host's part alone, apart from kernel time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def host_overhead(calls: int = 400, repeats: int = 7) -> list[HostResult]:
    """Host time per call on tiny (1, 2, 128, 64) bf16 inputs (kernel time is far below it): per case, the
    median and range of `repeats` loops of `calls` calls, the cases interleaved in each round so that a
    drift of the host's speed reaches them all. The single op's cases run again through Triton's own
    launch path at every call (no FastLaunch: what lit_thresh/ops/fast_launch.py saves), and with its
    Triton launches stubbed out ('no launch'): our Python and torch ops; the difference is the launcher.
    Each case repeats one signature, so from its third call it runs planned (lit_thresh/ops/call_plans.py).
    A training step's forward records its gradient: the 'grad recorded' rows (their graph freed unused), with
    beta an nn.Parameter as a model's learned beta is. The fused differential op's rows (where lit_thresh.ops has
    it) take q1, q2, k1, k2, v at half the head dim and a 0-d lambda, as the diff_threshold variant passes them."""
    from lit_thresh.ops import threshold_attention

    q, k, v = (_randn(1, 2, 128, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    beta = torch.nn.Parameter(torch.full((2,), 0.5, device="cuda"))
    beta_buffer = torch.full((2,), 0.5, device="cuda")
    dout = _randn(1, 2, 128, 64, dtype=torch.bfloat16)
    ours = {
        "threshold p=2 forward (no grad)": lambda: threshold_attention(qd, kd, vd, 0.5, 2.0),
        "threshold p=2 forward (no grad, (H,) beta)": lambda: threshold_attention(qd, kd, vd, beta_buffer, 2.0),
        "threshold p=2 forward (grad recorded, no backward)": lambda: threshold_attention(q, k, v, beta, 2.0),
        "threshold p=2 forward + backward": lambda: threshold_attention(q, k, v, beta, 2.0).backward(dout),
    }
    fused = _differential_op()
    if fused is not None:  # q1, q2, k1, k2, v at half the head dim, as the diff_threshold variant splits them
        q1, q2, k1, k2, vh = (_randn(1, 2, 128, 32, dtype=torch.bfloat16).requires_grad_() for _ in range(5))
        lam = torch.tensor(0.3, device="cuda", requires_grad=True)  # the variant's lambda: 0-d
        halves = [t.detach() for t in (q1, q2, k1, k2, vh)]
        dout_h = _randn(1, 2, 128, 32, dtype=torch.bfloat16)
        ours["differential p=2 forward (no grad)"] = lambda: fused(*halves, 0.5, 0.3, 2.0)
        ours["differential p=2 forward (grad recorded, no backward)"] = lambda: fused(q1, q2, k1, k2, vh, beta, lam, 2.0)
        ours["differential p=2 forward + backward"] = (
            lambda: fused(q1, q2, k1, k2, vh, beta, lam, 2.0).backward(dout_h))
    sdpa = {
        "sdpa forward (no grad)": lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True),
        "sdpa forward (grad recorded, no backward)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa forward + backward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout),
    }
    cases = [(name, fn, contextlib.nullcontext) for name, fn in {**ours, **sdpa}.items()]
    single = {name: fn for name, fn in ours.items() if name.startswith("threshold")}  # what those contexts swap
    cases += [(f"{name} [Triton's launch path]", fn, triton_path_launches) for name, fn in single.items()]
    cases += [(f"{name} [no launch]", fn, stubbed_launches) for name, fn in single.items()]
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(repeats):
        for name, fn, launches in cases:
            with launches():
                times[name].append(_host_us(fn, calls))
    return [HostResult(name, statistics.median(t), min(t), max(t)) for name, t in times.items()]


def _warm_point(task: tuple) -> str:
    """Worker: run each Triton kernel the grid uses once at (1, H, 256, D) (same specialisation as any
    T divisible by 16) so that the timing process finds it compiled in Triton's cache; the single op's
    default tiles both with their TMA loads (the grid's rows of at least TMA_MIN_WORK) and without, those of
    short maps and, at (1, H, 2304, D), of long ones (triton_launch.SHORT_KEYS)."""
    from lit_thresh.ops import threshold_attention, triton_launch
    from lit_thresh.ops.triton_launch import default_configs, triton_backward, triton_forward

    dtype_name, d, h, sparse = task
    dtype = DTYPES[dtype_name]
    q, k, v, q2, k2 = (_randn(1, h, 256, d, dtype=dtype).requires_grad_() for _ in range(5))
    beta = torch.full((h,), 0.5, device="cuda", requires_grad=True)
    lam = torch.full((h,), 0.3, device="cuda", requires_grad=True)
    dout = _randn(1, h, 256, d, dtype=dtype)
    errors = []
    long_map = [_randn(1, h, triton_launch.SHORT_KEYS[-1] + 256, d, dtype=dtype).requires_grad_() for _ in range(4)]

    def single(min_work: int, q=q, k=k, v=v, dout=dout) -> None:
        triton_launch.TMA_MIN_WORK = min_work  # this worker process only
        threshold_attention(q, k, v, beta, 2.0).backward(dout)

    runs = [lambda: single(0), lambda: single(1 << 62),
            lambda: single(0, *long_map), lambda: single(1 << 62, *long_map)]
    fused = _differential_op()
    if fused is not None:
        runs.append(lambda: fused(q, q2, k, k2, v, beta, lam, 2.0).backward(dout))
    if sparse:
        base = default_configs(d, dtype)
        skip = type(base)(*(replace(c, skip_zero=True) for c in (base.fwd, base.bwd_dkv, base.bwd_dq)))
        runs.append(lambda: triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, skip,
                                            live=triton_forward(q, k, v, beta, 2.0, 1.0, skip)[1]))
    for run in runs:
        try:
            run()
        except Exception as err:  # reported; the timing process meets it again and notes it in the table
            errors.append(f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}")
    torch.cuda.synchronize()
    return "; ".join(errors)


def warm_grid(dtypes: Sequence[str], head_dims: Sequence[int], heads: int, sparse: bool, workers: int) -> None:
    """Compile the grid's kernels in parallel processes before timing (compiles are minutes in series)."""
    tasks = [(name, d, heads, sparse) for name in dtypes for d in head_dims]
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=get_context("spawn")) as pool:
        for task, err in zip(tasks, pool.map(_warm_point, tasks)):
            if err:
                print(f"warm-up {task[:2]}: {err}", flush=True)


# -------------------------------------------------------------------------------------------------- sweep

SWEEP = {  # (block_m, block_n, num_warps, num_stages) tried per kernel with pointer and with TMA loads, plus
    # the default, and the default with skip_zero
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
            (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3)],
    "bwd_dkv": [(64, 64, 4, 3), (64, 64, 8, 2), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3),
                (32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (32, 32, 4, 3), (64, 64, 4, 4), (16, 128, 4, 3)],
    "bwd_dq": [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4),
               (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2), (64, 64, 8, 2)],
}


DIFF_SWEEP = {  # the same for the fused differential op's kernels; bwd_dk2 where the default has a second dK/dV launch
    "fwd": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3),
            (64, 32, 4, 3)],
    "bwd_dkv": [(32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 3), (64, 64, 8, 2), (64, 64, 4, 3), (32, 32, 4, 3),
                (32, 128, 8, 2), (64, 128, 8, 2)],
    "bwd_dk2": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)],
    "bwd_dq": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 3),
               (64, 32, 4, 2)],
}
SWEPT_OPS = {"": SWEEP, "diff ": DIFF_SWEEP}  # label prefix -> kernels: the single op's, the differential op's
SWEEP_OP_NAMES = {"single": "", "differential": "diff "}  # --sweep-ops' choices -> SWEPT_OPS' prefixes


def _sweep_inputs(b: int, h: int, t: int, d: int, dtype: torch.dtype, device: str = "cuda") -> dict[str, torch.Tensor]:
    """q, k, v, q2, k2 (B, H, T, D), dO, beta and lambda (H,): the single op takes q, k, v, the differential
    op both pairs."""
    names = ("q", "k", "v", "q2", "k2", "dout")
    inputs = {name: _randn(b, h, t, d, dtype=dtype, device=device) for name in names}
    return inputs | {"beta": torch.ones(h, device=device), "lam": torch.full((h,), 0.5, device=device)}


def _sweep_call(op: str, kernel: str, cfg, x: dict[str, torch.Tensor], large: bool = True) -> Callable[[], object]:
    """The call that times `kernel` of op ('' single, 'diff ' differential) at cfg, the other kernels at their
    defaults (the differential op's: its large calls' where large, as at the grid point swept): the forward, or
    the whole backward (with skip_zero, by the map of a forward run beforehand)."""
    from lit_thresh.ops.triton_differential import default_diff_configs, diff_triton_backward, diff_triton_forward
    from lit_thresh.ops.triton_launch import default_configs, triton_backward, triton_forward

    q, k, v, beta, dout = x["q"], x["k"], x["v"], x["beta"], x["dout"]
    d = q.shape[-1]
    defaults = default_diff_configs(d, q.dtype, large) if op else default_configs(d, q.dtype, q.shape[2])
    configs = replace(defaults, **{kernel: cfg})
    if op:
        pairs = (q, x["q2"], k, x["k2"], v, beta, x["lam"], 2.0, 1.0)
        if kernel == "fwd":
            return lambda: diff_triton_forward(*pairs, configs)
        return lambda: diff_triton_backward(*pairs, dout, True, True, configs)
    if kernel == "fwd":
        return lambda: triton_forward(q, k, v, beta, 2.0, 1.0, configs)[0]
    if getattr(configs, kernel).skip_zero:  # skipping by the forward's map, made untimed, as training does
        configs = replace(configs, fwd=replace(configs.fwd, skip_zero=True))
        live = triton_forward(q, k, v, beta, 2.0, 1.0, configs)[1]
        return lambda: triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, configs, live=live)
    return lambda: triton_backward(q, k, v, beta, 2.0, 1.0, dout, True, configs)


def _sweep_configs(op: str, kernel: str, d: int, dtype: torch.dtype, t: int, large: bool = True) -> list:
    """The default at length t (the differential op's: of its large calls where large) first, the default with
    skip_zero, then SWEPT_OPS[op][kernel], each with and without TMA loads; none where the default has no such
    kernel (bwd_dk2 at D <= 64, and in fp16 D = 128's small calls)."""
    from lit_thresh.ops.triton_differential import default_diff_configs
    from lit_thresh.ops.triton_launch import BlockConfig, default_configs

    default = getattr(default_diff_configs(d, dtype, large) if op else default_configs(d, dtype, t), kernel)
    if default is None:
        return []
    cfgs = [default, replace(default, skip_zero=True)]
    cfgs += [BlockConfig(*c, tma=tma) for c in SWEPT_OPS[op][kernel] for tma in (False, True)]
    return list(dict.fromkeys(cfgs))


def _compile_one(task: tuple) -> str:
    """Worker: run one config once at (1, H, T, D) so that its compiled kernel lands in Triton's cache."""
    op, kernel, cfg, h, t, d, dtype_name, large = task
    try:
        _sweep_call(op, kernel, cfg, _sweep_inputs(1, h, t, d, DTYPES[dtype_name]), large)()
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # out of shared memory or registers for this tile
        return f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"


def sweep(dtype: torch.dtype, d: int, t: int, b: int, h: int, timing: Timing, workers: int,
          ops: Sequence[str] = tuple(SWEEP_OP_NAMES)) -> list[Result]:
    """Time each kernel of the ops named (SWEEP_OP_NAMES: the single and the differential op) over SWEPT_OPS's
    configs, the other kernels at their defaults for a call of this size."""
    from lit_thresh.ops.triton_differential import large_call

    name = str(dtype).removeprefix("torch.")
    shape = torch.empty(b, h, t, d, device="meta")  # (B, H, T, D): only its size counts
    large = large_call(shape, shape, shape)
    swept = {SWEEP_OP_NAMES[op]: SWEPT_OPS[SWEEP_OP_NAMES[op]] for op in ops}
    keys = [(op, kernel, cfg) for op, kernels in swept.items() for kernel in kernels
            for cfg in _sweep_configs(op, kernel, d, dtype, t, large)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:  # compile in parallel
        errors = dict(zip(keys, pool.map(_compile_one, [(*key, h, t, d, name, large) for key in keys])))
    x = _sweep_inputs(b, h, t, d, dtype)
    out = []
    for op, kernels in swept.items():
        for kernel in kernels:
            timed = []
            for i, cfg in enumerate(_sweep_configs(op, kernel, d, dtype, t, large)):
                label = f"{op}{kernel} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                label += (" tma" if cfg.tma else "") + (" skip" if cfg.skip_zero else "")
                error = errors[(op, kernel, cfg)]
                res = Result(label, name, d, t, b, h, note=("default " if i == 0 else "") + error)
                if not error:
                    try:
                        ms = _median_ms(_sweep_call(op, kernel, cfg, x, large), [], timing)
                        if kernel == "fwd":
                            res.fwd_ms = ms
                        else:
                            res.fwd_bwd_ms = ms  # the whole backward, this kernel at cfg
                    except Exception as err:
                        res.note += f"{type(err).__name__}"
                timed.append(res)
            out += sorted(timed, key=lambda r: _finite_or_inf(r.fwd_ms if kernel == "fwd" else r.fwd_bwd_ms))
    return out


def is_sweep_row(result: Result) -> bool:
    """Whether a result is one of sweep()'s rows (not of the grid's table)."""
    return result.variant.startswith(tuple(f"{op}{kernel} " for op, kernels in SWEPT_OPS.items() for kernel in kernels))


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def format_sweep(results: Sequence[Result]) -> str:
    lines = ["sweep: ms of the forward (fwd) or of the whole backward (bwd_*; the other backward kernel at its "
             "default); diff: the fused differential op's kernels"]
    for r in results:
        ms = r.fwd_ms if r.variant.removeprefix("diff ").startswith("fwd") else r.fwd_bwd_ms
        lines.append(f"  {r.dtype:<8} D={r.head_dim:<4} T={r.seq_len:<6} {r.variant:<32} {_cell('{:>8.3f}', ms)}  {r.note}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- main


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_thresh.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--head-dims", type=_positive_int, nargs="+", default=[64, 128])
    parser.add_argument("--seq-lens", type=_positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", choices=sorted(DTYPES), nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--tokens", type=_positive_int, default=16384, help="B * T at every grid point")
    parser.add_argument("--heads", type=_positive_int, default=16)
    parser.add_argument("--zero-fractions", type=float, nargs="*", default=[0.5, 0.9, 0.99],
                        help="fractions of zero weights for the skip_zero rows (none: no such rows; 0: a dense "
                             "map, what skipping costs where there is nothing to skip)")
    parser.add_argument("--quick", action="store_true", help="shorter timing; sparse rows at the longest T only")
    parser.add_argument("--repeats", type=_positive_int, default=1,
                        help="rounds of each grid point's rows, interleaved: medians and spreads over them")
    parser.add_argument("--sweep", action="store_true",
                        help="first time block configs of each kernel (the single and the differential op's)")
    parser.add_argument("--sweep-ops", choices=list(SWEEP_OP_NAMES), nargs="+", default=list(SWEEP_OP_NAMES),
                        help="the ops whose kernels --sweep times")
    parser.add_argument("--no-table", action="store_true", help="skip the grid table (with --sweep: sweep only)")
    parser.add_argument("--no-host", action="store_true", help="skip the host-overhead measurement")
    parser.add_argument("--workers", type=_positive_int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling sweep configs in parallel")
    parser.add_argument("--csv", metavar="PATH", help="also write the results as CSV")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for t in args.seq_lens:
        if t > args.tokens or args.tokens % t:
            parser.error(f"--seq-lens: each T must divide --tokens ({args.tokens}), got {t}")
    for d in args.head_dims:
        if d > 256:
            parser.error(f"--head-dims: each D must be in [1, 256], got {d}")
    if any(not 0.0 <= f < 1.0 for f in args.zero_fractions):
        parser.error(f"--zero-fractions: each must be in [0, 1), got {args.zero_fractions}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        build_parser().error("the benchmark needs a CUDA device (torch.cuda.is_available() is False)")
    timing = Timing(10, 40) if args.quick else Timing()
    if not args.no_table:
        warm_grid(args.dtypes, args.head_dims, args.heads, bool(args.zero_fractions), args.workers)
    results: list[Result] = []
    for name in args.dtypes:
        for d in args.head_dims:
            for t in args.seq_lens:
                b = args.tokens // t
                if args.sweep:
                    swept = sweep(DTYPES[name], d, t, b, args.heads, timing, args.workers, args.sweep_ops)
                    print(format_sweep(swept), flush=True)
                    results += swept
                if args.no_table:
                    continue
                rounds = []
                for _ in range(args.repeats):
                    rows = grid_point(DTYPES[name], d, t, b, args.heads, timing)
                    if args.zero_fractions and (not args.quick or t == max(args.seq_lens)):
                        rows += sparse_rows(DTYPES[name], d, t, b, args.heads, args.zero_fractions, timing)
                    rounds.append(rows)
                point = combine_rounds(rounds)
                print(format_table(point).split("\n", 1)[1], flush=True)  # progress, without the header
                results += point
    host = [] if args.no_host else host_overhead()
    if not args.no_table:
        print(f"\nH = {args.heads}, B * T = {args.tokens}, causal; x cudnn / x flash = SDPA time / this row's time")
        print(format_table([r for r in results if not is_sweep_row(r)]))
    if host:
        print(format_host(host))
    if args.csv:
        write_csv(args.csv, results, host)


if __name__ == "__main__":
    main()
