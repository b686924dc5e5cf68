"""What the A/B scripts that compare package versions in one process share (results/diff_tma_ab.py,
results/mma_order_ab.py, results/grid_ab.py): the versions (copies of the package renamed lit_thresh_<name>, the
recipe of results/host_call_plans.py), their kernels compiled in parallel, interleaved rounds of `do_bench`, the
figures they print, and the single op's inputs and calls as the bench makes them."""

import concurrent.futures
import importlib
import multiprocessing
import statistics
import sys
from collections.abc import Callable, Hashable
from types import ModuleType

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS = 16  # the single op's calls: H = 16, beta 0.5 per head (learnable), p = 2


def versions(names: list[str]) -> dict[str, ModuleType]:
    """Each version's `ops` module, by name."""
    return {name: importlib.import_module(f"lit_thresh_{name}.ops") for name in names}


def compiled_versions(names: list[str], points: list[tuple], warm: Callable) -> dict[str, ModuleType]:
    """versions(names), their kernels compiled first: warm((name, *point)) for every version and grid point, in 16
    fresh processes (each compiles into the shared cache)."""
    tasks = [(name, *point) for name in names for point in points]
    with concurrent.futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(warm, tasks))
    return versions(names)


def interleaved(timed: dict[Hashable, Callable], rounds: int) -> dict[Hashable, list[float]]:
    """ms of each call over `rounds` rounds of `do_bench`, the calls interleaved, their order reversed every
    other round."""
    times = {key: [] for key in timed}
    for r in range(rounds):
        for key in (list(timed) if r % 2 == 0 else list(timed)[::-1]):
            times[key].append(triton.testing.do_bench(timed[key], warmup=25, rep=100))
    return times


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error norm of a against b."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def spread(ts: list[float]) -> str:
    """median [min - max]."""
    return f"{statistics.median(ts):7.3f} [{min(ts):.3f} - {max(ts):.3f}]"


def command_line(seq_lens: tuple[int, ...]) -> tuple[list[str], tuple[int, ...]]:
    """`script.py [NAME,NAME [T,T,...]]`: the two versions' names (main,new by default) and the lengths to run
    (seq_lens by default)."""
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["main", "new"]
    return names, tuple(map(int, sys.argv[2].split(","))) if len(sys.argv) > 2 else seq_lens


def single_inputs(dtype: torch.dtype, d: int, t: int, b: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The single op's inputs as the bench's grid makes them: (q, k, v, beta), dout; q, k, v, dout ~ 0.5 N(0, 1)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (0.5 * torch.randn(b, HEADS, t, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    beta = torch.full((HEADS,), 0.5, device="cuda")
    return (q, k, v, beta), dout  # (B, H, T, D) each, beta (H,)


def leaves(x) -> list[torch.Tensor]:
    """Fresh leaves holding gradients, so that no backward adds into an earlier call's gradients."""
    return [t.detach().requires_grad_() for t in x]


def single_fwd_bwd(ops: ModuleType, x, dout: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    """A call of one version's `threshold_attention` forward+backward: its output, then its inputs (fresh leaves
    at each call, holding their gradients)."""
    def run() -> list[torch.Tensor]:
        ins = leaves(x)
        out = ops.threshold_attention(*ins, 2.0)
        out.backward(dout)
        return [out, *ins]
    return run


def cudnn_call(x, dout: torch.Tensor, backward: bool = True) -> Callable[[], None]:
    """SDPA-cuDNN on the same q, k, v (causal): the forward, or the forward+backward on fresh leaves."""
    def run() -> None:
        q, k, v = leaves(x[:3])
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.backward(dout)
    return run


def warm_single(task: tuple) -> None:
    """compiled_versions' worker for the single op: one version's kernels at one grid point (name, dtype name, D, T),
    at B = 1 and the same T (the same specialisation)."""
    name, dtype_name, d, t = task
    x, dout = single_inputs(getattr(torch, dtype_name), d, t, 1)
    single_fwd_bwd(importlib.import_module(f"lit_thresh_{name}.ops"), x, dout)()
    torch.cuda.synchronize()
