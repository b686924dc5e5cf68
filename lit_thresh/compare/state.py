"""What a run's folder holds, and who may touch it: finished (``results.json``), resumable (an unfinished
run's ``last.ckpt``, started with the configuration asked for now), in use (its lock held), and which of
its checkpoints is the best.

A compare holds ``ROOT/.compare_locks/VARIANT[/CELL]/seedS/.lit_thresh.lock`` (lit_thresh.resume.RunLock)
while it decides about a run and runs it, so that a second compare on the same root (``--rerun``, or the
same command twice) does not move a live run aside or write into it; a fit holds its own run folder's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lit_thresh.compare.fingerprint import config_hash, describe_change, fingerprint
from lit_thresh.compare.plan import Run
from lit_thresh.resume import LAST, RunLock, read_checkpoint

STARTED = "started.json"  # written when a run starts from scratch: its arguments and configuration
LOCKS = ".compare_locks"  # under ROOT: the compares' run locks


class RunFailed(RuntimeError):
    """A run of the comparison exited with an error, or cannot be run now."""


class CannotResume(ValueError):
    """An unfinished run that must start over; the message says why."""


def record(args: Sequence[str]) -> dict:
    """What results.json and started.json keep of a run's configuration: its arguments, their parts
    (config contents by hash: lit_thresh.compare.fingerprint) and the hash of those."""
    parts = fingerprint(args)
    return {"args": list(args), "config": parts, "config_hash": config_hash(parts)}


def change(recorded: dict, args: Sequence[str]) -> str | None:
    """None when `recorded` (a results.json or started.json) was made with the configuration of `args`
    (the same config contents and other arguments), else what differs, in words."""
    if "config_hash" not in recorded:  # written by an older compare, which kept the arguments only
        return None if recorded.get("args") == list(args) else "its arguments changed"
    now = record(args)
    if recorded["config_hash"] == now["config_hash"]:
        return None
    return describe_change(recorded.get("config", []), now["config"])


@contextmanager
def run_lock(root: Path, run: Run) -> Iterator[None]:
    """Holds the compare lock of `run` under `root`; RunFailed when another process holds it."""
    lock = RunLock(root / LOCKS / run.group / f"seed{run.seed}")
    try:
        lock.acquire()
    except ValueError:
        raise RunFailed(f"run {run.name}: another lit_thresh compare is running it (it holds {lock.path}); "
                        "wait for that one to end, or stop it, then run the command again") from None
    try:
        yield
    finally:
        lock.release()


def check_not_in_use(run_dir: Path, name: str) -> None:
    """RunFailed when a fit still writes into run_dir (it holds the folder's RunLock)."""
    lock = RunLock(run_dir)
    if not lock.path.is_file():
        return
    try:
        lock.acquire()
    except ValueError:
        raise RunFailed(f"run {name}: a fit is still writing into {run_dir} (it holds {lock.path.name}); "
                        "wait for it to end, or stop it, then run the command again") from None
    lock.release()


def fitted(run_dir: Path, args: Sequence[str]) -> dict | None:
    """The started.json of a run whose fit finished with the configuration of `args` (only its test and
    results.json are left), else None."""
    started = run_dir / STARTED
    if not started.is_file():
        return None
    recorded = json.loads(started.read_text())
    return recorded if recorded.get("fitted") and change(recorded, args) is None else None


def resume_point(run_dir: Path, args: Sequence[str]) -> tuple[Path, int]:
    """The last.ckpt of an unfinished run and its step, when the run was started with the configuration
    of `args`; CannotResume saying why not otherwise."""
    last = run_dir / "checkpoints" / LAST
    if not last.is_file():
        raise CannotResume(f"unfinished, without a {LAST} to resume from")
    started = run_dir / STARTED
    if not started.is_file():
        raise CannotResume(f"unfinished, without the {STARTED} that says how it was started")
    changed = change(json.loads(started.read_text()), args)
    if changed is not None:
        raise CannotResume(f"unfinished, started with another configuration: {changed}")
    try:
        step = int(read_checkpoint(last).get("global_step", 0))
    except (OSError, ValueError) as error:
        raise CannotResume(f"unfinished, and its {LAST} cannot be read: {error}") from None
    return last, step


def move_aside(run_dir: Path) -> Path:
    """Renames run_dir to ``<run_dir>.old-N`` (the first N free); returns the new path."""
    n = 1
    while (old := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    os.rename(run_dir, old)
    return old


def _named_best(path: Path) -> tuple[int, str] | None:
    """(global step, file name of the best checkpoint) as a checkpoint's ModelCheckpoint state records
    them (a monitored one), or None."""
    try:
        checkpoint = read_checkpoint(path)
    except (OSError, ValueError):
        return None
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and state.get("monitor") and state.get("best_model_path"):
            return int(checkpoint.get("global_step", -1)), Path(state["best_model_path"]).name
    return None


def best_checkpoint(run_dir: Path) -> Path:
    """The checkpoint to test: the one ModelCheckpoint kept besides last.ckpt; of several (save_top_k > 1)
    the best by its monitored metric, as the newest checkpoint's ModelCheckpoint state names it (last.ckpt,
    written after every validation, or the newest kept one); last.ckpt when it kept none."""
    checkpoints = run_dir / "checkpoints"
    kept = {path.name: path for path in sorted(checkpoints.glob("*.ckpt")) if not path.name.startswith("last")}
    if len(kept) == 1:
        return next(iter(kept.values()))
    last = checkpoints / LAST
    if kept:
        named = [best for path in [last, *kept.values()] if path.is_file() and (best := _named_best(path))]
        named = [(step, name) for step, name in named if name in kept]
        if named:
            return kept[max(named)[1]]
        raise RunFailed(f"{checkpoints}: {len(kept)} checkpoints besides {LAST} and no ModelCheckpoint state "
                        "that names the best of them; test one by hand (lit_thresh test --ckpt_path PATH)")
    if last.is_file():
        return last
    raise RunFailed(f"{run_dir}: no checkpoint to test in {checkpoints} (test: true needs checkpointing)")
