"""Running a comparison's runs: each a ``lit_thresh fit`` (then ``test``) subprocess, several at once over
the visible GPUs (each pinned with CUDA_VISIBLE_DEVICES) or the CPU (OMP_NUM_THREADS split between them).

A run is finished once its ``results.json`` exists; finished runs made with the configuration asked for
now are skipped. An unfinished run started with it resumes from its ``last.ckpt``; any other folder of a
run to run is kept as ``<folder>.old-N`` and the run starts over (lit_thresh.compare.state, which also
holds the locks that keep a second compare off a live run). A failing run stops the comparison (no new
run starts, the running ones finish) unless ``--keep_going``; runs that ran out of memory on a GPU they shared
run again after the others, with half as many runs per GPU (down to one). Ctrl-C terminates every run
(Interrupted).
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
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import yaml
from jsonargparse import Namespace

from lit_thresh.compare.plan import Run, run_args
from lit_thresh.compare.results import RESULTS, eval_length, final_scalars, write_atomic
from lit_thresh.compare.state import (
    STARTED,
    CannotResume,
    RunFailed,
    best_checkpoint,
    change,
    check_not_in_use,
    fitted,
    move_aside,
    record,
    resume_point,
    run_lock,
)

STOP_TIMEOUT_S = 30  # after SIGTERM, how long a run may take to stop before SIGKILL
OUT_OF_MEMORY = (  # what a run's log says when its GPU ran out (the allocator's error, or CUDA's or cuBLAS's own)
    b"torch.OutOfMemoryError", b"CUDA out of memory", b"CUDA error: out of memory", b"CUBLAS_STATUS_ALLOC_FAILED")
LOGS = ("fit.log", "test.log")


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


STOP = threading.Event()  # set by Ctrl-C, SIGTERM or SIGHUP inside signals_as_interrupt; run_all acts on it


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """In the block, Ctrl-C, SIGTERM and SIGHUP (a closed terminal) only set STOP; run_all's loop then
    terminates the runs (which, in sessions of their own, would not get the signal) and raises Interrupted.
    A KeyboardInterrupt raised by the signal itself could land inside the thread pool's or a future's
    locks and leave them held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        STOP.set()

    STOP.clear()
    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
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


def logging_args(root: Path, run: Run) -> list[str]:
    """Seed and TensorBoard run directory ``root/VARIANT[/CELL]/seedS``."""
    logger = "--trainer.logger.init_args"
    return [
        f"--seed_everything={run.seed}",
        f"{logger}.save_dir={root.absolute()}",
        f"{logger}.name={run.group}",
        f"{logger}.version=seed{run.seed}",
    ]


def train(cfg: Namespace, run: Run, env: dict[str, str], prefix: bool = False) -> dict:
    """Fits (and tests) one run and writes its results.json; returns the results. Holds the run's compare
    lock throughout (RunFailed if another compare holds it). Decided under the lock: a run finished
    meanwhile is returned as it is; one whose fit finished with this configuration is only tested (an
    interrupted test); an unfinished one started with this configuration resumes from its last.ckpt; any
    other folder of the run is moved aside (<folder>.old-N) and the run starts over."""
    root = Path(cfg.root)
    run_dir = run.dir(root)
    args = run_args(cfg, run)
    with run_lock(root, run):
        if (done := finished(cfg, run, show=False)) is not None:
            return done
        resume: tuple[Path, int] | None = None
        started: dict | None = None  # started.json, once a fit with this configuration has finished
        if run_dir.exists():
            check_not_in_use(run_dir, run.name)
            if (started := fitted(run_dir, args)) is not None:
                PROCESSES.show(f"[{run.name}] fitted before: testing it\n")
            else:
                if (run_dir / RESULTS).is_file():  # --rerun of a run finished with another configuration
                    previous = json.loads((run_dir / RESULTS).read_text())
                    why = f"finished with another configuration: {change(previous, args)}"
                else:
                    try:
                        resume = resume_point(run_dir, args)
                    except CannotResume as error:
                        why = str(error)
                if resume is None:
                    PROCESSES.show(f"[{run.name}] starting over ({why}): the old folder is now {move_aside(run_dir)}\n")
        if started is None:
            fit_args = [*args, *logging_args(root, run)]
            if resume is None:
                run_dir.mkdir(parents=True)
                started = record(args) | {"started": time.time()}  # the configs as they are when the fit starts
                write_atomic(run_dir / STARTED, json.dumps(started, indent=2))
            else:
                checkpoint, step = resume
                started = json.loads((run_dir / STARTED).read_text())
                PROCESSES.show(f"[{run.name}] unfinished: resuming it from {checkpoint} (step {step})\n")
                # TensorBoard hides what the interrupted fit logged after the checkpoint: it is logged again
                fit_args += [f"--ckpt_path={checkpoint}", f"--trainer.logger.init_args.purge_step={step}"]
            launch("fit", fit_args, run_dir / "fit.log", run.name, env, prefix)
            started["fitted"] = True  # should the test be lost, a later compare only tests it
            write_atomic(run_dir / STARTED, json.dumps(started, indent=2))
        if cfg.test:  # from the fit's own resolved config: immune to config files edited since
            test_args = [f"--config={run_dir / 'config.yaml'}", *logging_args(root, run)]
            test_args.append(f"--ckpt_path={best_checkpoint(run_dir)}")
            launch("test", test_args, run_dir / "test.log", run.name, env, prefix)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        length, pairs = eval_length(config)
        monitor = config.get("checkpoint") or {}
        results = {
            "variant": run.variant,
            "cell": dict(run.cell),
            "seed": run.seed,
            **{key: value for key, value in started.items() if key != "fitted"},  # what the fit started from
            "eval_length": length,
            "eval_pairs": pairs,
            "metrics": final_scalars(run_dir, monitor.get("monitor"), monitor.get("mode") or "min"),
            "finished": time.time(),
        }
        write_atomic(run_dir / RESULTS, json.dumps(results, indent=2))
        return results


def finished(cfg: Namespace, run: Run, show: bool = True) -> dict | None:
    """The run's results.json, or None when it must run: never finished, or (with --rerun) finished with
    another configuration than now (other config contents or arguments: lit_thresh.compare.state.change).
    show: say so (skipped, or why it runs again)."""
    done = run.dir(Path(cfg.root)) / RESULTS
    if not done.is_file():
        return None
    result = json.loads(done.read_text())
    changed = change(result, run_args(cfg, run))
    say = PROCESSES.show if show else lambda text: None
    if changed is None:
        say(f"[{run.name}] done before, skipped ({done})\n")
        return result
    if cfg.rerun:
        say(f"[{run.name}] done before with another configuration ({changed}): running it again (--rerun)\n")
        return None
    say(f"[{run.name}] warning: done before with another configuration ({changed}), skipped; --rerun runs it "
        f"again (keeping the old one as {done.parent.name}.old-N)\n")
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


def _device_group(slot: dict[str, str]) -> tuple:
    """A slot's device group, hashable: the slots of one group share its GPUs."""
    return tuple(sorted(slot.items()))


def _fewer(slots: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The slots with half as many per device group, at least one: where runs that ran out of memory sharing
    their GPU run again."""
    keep = {group: max(1, count // 2) for group, count in Counter(map(_device_group, slots)).items()}
    fewer = []
    for slot in slots:  # in the slots' order
        if keep[group := _device_group(slot)]:
            fewer.append(slot)
            keep[group] -= 1
    return fewer


def _log_sizes(run_dir: Path) -> dict[str, int]:
    """The sizes of a run's logs now (they are appended to by each attempt)."""
    return {name: (run_dir / name).stat().st_size if (run_dir / name).is_file() else 0 for name in LOGS}


def _ran_out_of_memory(run_dir: Path, sizes: dict[str, int]) -> bool:
    """Whether what the run's logs got past `sizes` reports CUDA out-of-memory."""
    for name, size in sizes.items():
        if (run_dir / name).is_file():
            with (run_dir / name).open("rb") as log:
                log.seek(size)
                written = log.read()
            if any(marker in written for marker in OUT_OF_MEMORY):
                return True
    return False


def run_all(
    cfg: Namespace, runs: Sequence[Run], check: Callable[[Run, dict], None], slots: Sequence[dict[str, str]]
) -> tuple[dict[Run, dict], dict[Run, str]]:
    """Every run not finished yet, one per slot at once (slots: each one's environment, device_slots);
    check(run, results) after each. The first failure (RunFailed, or an error check raises) starts no
    new run, lets the running ones finish and is raised; with ``cfg.keep_going`` a failing run is only
    recorded. A run that ran out of GPU memory while sharing its GPU is no failure: once the others are
    done, such runs run again (resuming from their last.ckpt, if any) with half as many per GPU (_fewer),
    down to one; alone on a GPU, running out of memory is a failure. Ctrl-C terminates the runs and raises
    Interrupted. Returns the finished runs' results and the failed runs' errors, in run order."""
    results: dict[Run, dict] = {}
    failures: dict[Run, str] = {}
    groups = set(map(_device_group, slots))  # fewer than slots: runs share a GPU
    retry: set[Run] = set()
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
            if failed.is_set() or PROCESSES.stopping:  # Ctrl-C while it waited: no folder for it
                return
            if slot:
                PROCESSES.show(f"[{run.name}] on {', '.join(f'{k}={v}' for k, v in slot.items())}\n")
            run_dir = run.dir(Path(cfg.root))
            sizes = _log_sizes(run_dir)
            try:
                results[run] = train(cfg, run, os.environ | slot, prefix=len(slots) > 1)
            except RunFailed as error:
                shared = "CUDA_VISIBLE_DEVICES" in slot and len(groups) < len(slots)
                if shared and _ran_out_of_memory(run_dir, sizes):
                    retry.add(run)
                    PROCESSES.show(f"[{run.name}] out of GPU memory with other runs on its GPU: it runs again once "
                                   "they are done, with fewer runs per GPU\n")
                    return
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
            if STOP.is_set():
                raise KeyboardInterrupt
            pending = wait(pending, timeout=0.2).not_done
    except KeyboardInterrupt:
        stopped = PROCESSES.terminate_all()
        executor.shutdown(wait=True, cancel_futures=True)
        raise Interrupted(f"{stopped} run(s) stopped") from None
    executor.shutdown()
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    if retry:
        again, failed_again = run_all(cfg, [run for run in runs if run in retry], check, _fewer(slots))
        results |= again
        failures |= failed_again
    done = {run: results[run] for run in runs if run in results}  # in run order, not as they finished
    return done, {run: failures[run] for run in runs if run in failures}
