"""What the A/B scripts that compare package versions in one process share (results/diff_tma_ab.py,
results/mma_order_ab.py): the versions (copies of the package renamed lit_thresh_<name>, the recipe of
results/host_call_plans.py), their kernels compiled in parallel, interleaved rounds of `do_bench`, and the
figures they print."""

import concurrent.futures
import importlib
import multiprocessing
import statistics
import sys
from collections.abc import Callable, Hashable
from types import ModuleType

import torch
import triton


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
