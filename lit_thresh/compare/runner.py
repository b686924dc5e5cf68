"""Running a comparison's runs: each a ``lit_thresh fit`` (then ``test``) subprocess, several at once over
the visible GPUs (each pinned with CUDA_VISIBLE_DEVICES) or the CPU (OMP_NUM_THREADS split between them).

A run is finished once its ``results.json`` exists; finished runs are skipped, unfinished ones start over
(their old folder kept as ``<folder>.old-N``). A failing run stops the comparison (no new run starts, the
running ones finish) unless ``--keep_going``. Ctrl-C terminates every run (Interrupted).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import yaml
from jsonargparse import Namespace

from lit_thresh.compare.plan import Run, run_args
from lit_thresh.compare.results import RESULTS, eval_length, final_scalars, write_atomic

STOP_TIMEOUT_S = 30  # after SIGTERM, how long a run may take to stop before SIGKILL


class RunFailed(RuntimeError):
    """A run of the comparison exited with an error."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the runs in progress were terminated."""


class _Processes:
    """The runs' live subprocesses (each in its own session), to terminate them all on Ctrl-C; after
    that, output is no longer shown and no process starts."""

    def __init__(self) -> None:
        self.lock, self.print_lock = threading.Lock(), threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.stopping = False
        self.show: Callable[[str], None] = self._print

    def _print(self, text: str) -> None:
        with self.print_lock:  # whole lines from the runs' threads
            sys.stdout.write(text)
            sys.stdout.flush()

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        with self.lock:
            if self.stopping:
                raise Interrupted
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       errors="replace", env=env, start_new_session=True)
            self.live.add(process)
            return process

    def finished(self, process: subprocess.Popen) -> None:
        with self.lock:
            self.live.discard(process)

    def terminate_all(self) -> int:
        """SIGTERM to every run's process group (DDP ranks included), SIGKILL after STOP_TIMEOUT_S;
        returns how many runs were stopped."""
        with self.lock:
            self.stopping = True
            self.show = lambda text: None
            live = list(self.live)
        for process in live:
            _signal_group(process, signal.SIGTERM)
        for process in live:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        return len(live)


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """In the block, SIGTERM and SIGHUP (a closed terminal) end the comparison as Ctrl-C does, terminating
    its runs (which, in sessions of their own, would not get them) instead of leaving them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:  # already gone
        pass


PROCESSES = _Processes()


def launch(subcommand: str, args: Sequence[str], log: Path, run: str, env: dict[str, str], prefix: bool) -> None:
    """Runs ``python -m lit_thresh SUBCOMMAND ARGS`` with env, its output to log and to the terminal
    (each line prefixed with ``[run]`` when prefix)."""
    command = [sys.executable, "-m", "lit_thresh", subcommand, *args]
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        PROCESSES.show(f"[{run}] lit_thresh {subcommand} (output also in {log})\n")
        process = PROCESSES.start(command, env | {"PYTHONUNBUFFERED": "1"})
        try:
            for line in process.stdout:
                out.write(line)
                PROCESSES.show(f"[{run}] {line}" if prefix else line)
            process.wait()
        finally:
            PROCESSES.finished(process)
    if PROCESSES.stopping:
        raise Interrupted
    if process.returncode != 0:
        raise RunFailed(f"run {run}: `lit_thresh {subcommand}` exited with code {process.returncode}; see {log}")


def best_checkpoint(run_dir: Path) -> Path:
    """The checkpoint ModelCheckpoint kept besides last.ckpt (its best, with the default save_top_k=1),
    else last.ckpt."""
    checkpoints = run_dir / "checkpoints"
    best = [path for path in checkpoints.glob("*.ckpt") if not path.name.startswith("last")]
    if len(best) == 1:
        return best[0]
    if (checkpoints / "last.ckpt").is_file():
        return checkpoints / "last.ckpt"
    raise RunFailed(f"{run_dir}: no checkpoint to test in {checkpoints} (test: true needs checkpointing)")


def logging_args(root: Path, run: Run) -> list[str]:
    """Seed and TensorBoard run directory ``root/VARIANT[/CELL]/seedS``."""
    logger = "--trainer.logger.init_args"
    return [
        f"--seed_everything={run.seed}",
        f"{logger}.save_dir={root.absolute()}",
        f"{logger}.name={run.group}",
        f"{logger}.version=seed{run.seed}",
    ]


def move_aside(run_dir: Path) -> Path:
    """Renames run_dir to ``<run_dir>.old-N`` (the first N free); returns the new path."""
    n = 1
    while (old := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    run_dir.rename(old)
    return old


def train(cfg: Namespace, run: Run, env: dict[str, str], prefix: bool = False) -> dict:
    """Fits (and tests) one run from scratch, an older folder of it moved aside, and writes its
    results.json; returns the results."""
    root = Path(cfg.root)
    run_dir = run.dir(root)
    if run_dir.exists():
        PROCESSES.show(f"[{run.name}] starting over: the old folder is now {move_aside(run_dir)}\n")
    run_dir.mkdir(parents=True)
    started = time.time()
    args = run_args(cfg, run)
    launch("fit", [*args, *logging_args(root, run)], run_dir / "fit.log", run.name, env, prefix)
    if cfg.test:  # from the fit's own resolved config: immune to config files edited since
        test_args = [f"--config={run_dir / 'config.yaml'}", *logging_args(root, run)]
        test_args.append(f"--ckpt_path={best_checkpoint(run_dir)}")
        launch("test", test_args, run_dir / "test.log", run.name, env, prefix)
    length, pairs = eval_length(yaml.safe_load((run_dir / "config.yaml").read_text()))
    results = {
        "variant": run.variant,
        "cell": dict(run.cell),
        "seed": run.seed,
        "args": args,
        "eval_length": length,
        "eval_pairs": pairs,
        "metrics": final_scalars(run_dir),
        "started": started,  # seconds since the epoch
        "finished": time.time(),
    }
    write_atomic(run_dir / RESULTS, json.dumps(results, indent=2))
    return results


def finished(cfg: Namespace, run: Run) -> dict | None:
    """The run's results.json, or None when it must run: never finished, or (with --rerun) finished
    with other arguments than now."""
    done = run.dir(Path(cfg.root)) / RESULTS
    if not done.is_file():
        return None
    result = json.loads(done.read_text())
    if result["args"] == run_args(cfg, run):
        PROCESSES.show(f"[{run.name}] done before, skipped ({done})\n")
        return result
    if cfg.rerun:
        PROCESSES.show(f"[{run.name}] ran with other arguments: running it again (--rerun)\n")
        return None
    PROCESSES.show(f"[{run.name}] warning: done before with other arguments, skipped; --rerun runs it again "
                   f"(keeping the old one as {done.parent.name}.old-N)\n")
    return result


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them (no CUDA context made)."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",") if name.strip()] if visible is not None else []
    return names[:count] if visible is not None else [str(i) for i in range(count)]


def device_slots(runs_per_device: int, devices_per_run: int) -> list[dict[str, str]]:
    """The environment of each run that may go at once: with GPUs, runs_per_device runs on each group of
    devices_per_run GPUs (CUDA_VISIBLE_DEVICES); on CPU, runs_per_device runs sharing the cores
    (OMP_NUM_THREADS; one run keeps torch's default)."""
    gpus = visible_gpus()
    if not gpus:
        if runs_per_device == 1:
            return [{}]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // runs_per_device)  # of the cores this process may use (SLURM, taskset)
        return [{"OMP_NUM_THREADS": str(threads)}] * runs_per_device
    if devices_per_run > len(gpus):
        raise ValueError(f"devices_per_run: {devices_per_run} GPUs per run, but {len(gpus)} are visible ({gpus})")
    groups = [gpus[i : i + devices_per_run] for i in range(0, len(gpus) - devices_per_run + 1, devices_per_run)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(group)} for group in groups for _ in range(runs_per_device)]


def run_all(
    cfg: Namespace, runs: Sequence[Run], check: Callable[[Run, dict], None], slots: Sequence[dict[str, str]]
) -> tuple[dict[Run, dict], dict[Run, str]]:
    """Every run not finished yet, one per slot at once (slots: each one's environment, device_slots);
    check(run, results) after each. The first failure (RunFailed, or an error check raises) starts no
    new run, lets the running ones finish and is raised; with ``cfg.keep_going`` a failing run is only
    recorded. Ctrl-C terminates the runs and raises Interrupted. Returns the finished runs' results and
    the failed runs' errors, in run order."""
    results: dict[Run, dict] = {}
    failures: dict[Run, str] = {}
    todo = []
    for run in runs:
        result = finished(cfg, run)
        if result is None:
            todo.append(run)
        else:
            results[run] = result
            check(run, result)
    if not todo:
        return results, failures
    free: queue.SimpleQueue[dict[str, str]] = queue.SimpleQueue()
    for slot in slots:
        free.put(slot)
    failed = threading.Event()

    def one(run: Run) -> None:
        if failed.is_set():
            return
        slot = free.get()
        try:
            if failed.is_set():
                return
            if slot:
                PROCESSES.show(f"[{run.name}] on {', '.join(f'{k}={v}' for k, v in slot.items())}\n")
            try:
                results[run] = train(cfg, run, os.environ | slot, prefix=len(slots) > 1)
            except RunFailed as error:
                if not cfg.keep_going:
                    raise
                failures[run] = str(error)
                PROCESSES.show(f"[{run.name}] failed, going on (--keep_going): {error}\n")
                return
            check(run, results[run])
        except Exception:
            failed.set()
            raise
        finally:
            free.put(slot)

    executor = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="compare-run")
    futures = []
    try:
        futures += [executor.submit(one, run) for run in todo]
        pending = set(futures)
        while pending:  # a timeout, so that Ctrl-C is seen at once
            pending = wait(pending, timeout=1.0).not_done
    except KeyboardInterrupt:
        stopped = PROCESSES.terminate_all()
        executor.shutdown(wait=True, cancel_futures=True)
        raise Interrupted(f"{stopped} run(s) stopped") from None
    executor.shutdown()
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    done = {run: results[run] for run in runs if run in results}  # in run order, not as they finished
    return done, {run: failures[run] for run in runs if run in failures}
