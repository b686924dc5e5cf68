"""May this checkpoint start this run? Every check of a ``ckpt_path`` against the given config, on one read.

``lit_thresh fit --ckpt_path last`` continues the latest run in its own directory (:func:`resolve_last`);
an explicit path and ``last`` go through the same checks: the file is read once, with
``weights_only=True`` (a checkpoint whose pickle would run code is refused), before any class is built
(:func:`read_for_run`); once model and data are built, its weights, model hyperparameters and training
order must fit them (:func:`check_run`). A fit then holds the lock of the folders its checkpoints go to
(:func:`lock_run`), so that a second process resuming the same run is refused instead of writing into it too.
"""

import dataclasses
import inspect
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only

from lit_thresh.cli_errors import one_line
from lit_thresh.data.resumable import ResumableDataModule
from lit_thresh.lightning_compat import checkpoint_dir

LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION  # last.ckpt
LOCK_NAME = ".lit_thresh.lock"  # in a run's folder (lock_run), held by the fit writing into it
# ckpt_path values Lightning resolves itself rather than reading a file (and "registry:...").
SPECIAL_CKPT_PATHS = ("best", "last", "hpc", "registry")


def is_file_path(ckpt_path: str | None) -> bool:
    """Whether `ckpt_path` names a local file, rather than one of Lightning's names or a remote path."""
    return bool(ckpt_path) and "://" not in ckpt_path and ckpt_path.split(":")[0] not in SPECIAL_CKPT_PATHS


def read_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint at `ckpt_path`, read with ``weights_only=True`` (tensors and plain data, no
    code), its tensors memory-mapped. FileNotFoundError / ValueError starting with the path otherwise: a
    missing, empty, truncated or foreign file, or one whose pickle would run code."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the checkpoint file is empty (0 bytes)")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a checkpoint (not a file torch.save writes; a truncated or damaged one?)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:  # weights_only refused an object: loading it would run code
        raise ValueError(
            f"{path}: refused: the checkpoint holds objects other than tensors and plain data, which loading "
            f"would run as code (torch.load weights_only=True: {one_line(str(err)).split('. ')[0]})"
        ) from err
    except Exception as err:  # torch.load reports a damaged file in many ways
        raise ValueError(f"{path}: not a checkpoint torch.load reads: {one_line(str(err))}") from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path}: not a Lightning checkpoint (it has no state_dict)")
    return checkpoint


def latest_run(root: Path) -> Path | None:
    """The ``root/version_*`` run directory whose ``checkpoints/last.ckpt`` was written last, if any."""
    runs = [run for run in root.glob("version_*") if (run / "checkpoints" / LAST).is_file()]
    return max(runs, key=lambda run: (run / "checkpoints" / LAST).stat().st_mtime, default=None)


def resolve_last(config: Namespace) -> Namespace | None:
    """Turns a subcommand config's ``ckpt_path: last`` into the path of the checkpoint it resumes; returns
    the logger's ``init_args`` when their ``version`` was set to the resumed run's.

    With the default checkpoint folder, that is the newest ``last.ckpt`` among the logger's runs
    (``<save_dir>/<name>/version_N``), and the logger's ``version`` is set to N, so the resumed run writes
    into the same directory instead of a new ``version_N``; with the logger's ``version`` given, that
    run's ``last.ckpt``. With ``checkpoint.dirpath``
    set, it is ``<dirpath>/last.ckpt``. Without any ``last.ckpt``, ``last`` stays, and Lightning starts the
    run from scratch with a warning: the same command starts a run and resumes it.
    """
    if config.get("ckpt_path") != "last":
        return None
    dirpath = config.get("checkpoint.dirpath")
    if dirpath is not None:
        if (Path(dirpath) / LAST).is_file():
            config.ckpt_path = str(Path(dirpath) / LAST)
        return None
    logger = config.get("trainer.logger")
    args = logger.get("init_args") if isinstance(logger, Namespace) else None
    if args is None or not {"save_dir", "name", "version"} <= set(vars(args)):
        return None  # no logger, or one that does not write <save_dir>/<name>/version_N
    root = Path(args.save_dir or ".") / (args.name or "")
    if args.version is not None:  # the run asked for: its last.ckpt, not the latest run's
        run = root / (f"version_{args.version}" if isinstance(args.version, int) else str(args.version))
        if (run / "checkpoints" / LAST).is_file():
            config.ckpt_path = str(run / "checkpoints" / LAST)
        return None
    run = latest_run(root)
    if run is None:
        return None
    config.ckpt_path = str(run / "checkpoints" / LAST)
    version = run.name.removeprefix("version_")
    args.version = int(version) if version.isdigit() else version
    return args


def read_for_run(config: Namespace, model_class: type, fit: bool) -> dict[str, Any] | None:
    """Resolves a subcommand config's ``ckpt_path`` (resolve_last) and reads the checkpoint it names, once:
    the checkpoint, or None when there is no local file to read (none given, or one Lightning resolves).

    Refuses what can be told before the model is built: a damaged or unsafe file (read_checkpoint), one of
    another model class (hyperparameters that are not arguments of `model_class`), and
    ``weights_only: false`` (Lightning's load would then run a checkpoint's code). Resuming ``fit``
    into the run's own directory, a TensorBoardLogger's ``purge_step`` becomes the checkpoint's step, so
    TensorBoard hides what the interrupted run logged after it (the resumed run logs those steps again).
    """
    if config.get("weights_only") is False:
        raise ValueError(
            "weights_only false would let a checkpoint run code when it is loaded; lit_thresh loads "
            "checkpoints with weights_only=True (leave it unset)"
        )
    if "weights_only" in config:
        config.weights_only = True  # also for remote paths, which Lightning would load with False
    logger_args = resolve_last(config)
    ckpt_path = config.get("ckpt_path")
    if not is_file_path(ckpt_path):
        return None
    checkpoint = read_checkpoint(ckpt_path)
    hparams = checkpoint.get("hyper_parameters") or {}
    accepted = set(inspect.signature(model_class).parameters) | {"_instantiator", "_class_path"}
    unknown = sorted(set(hparams) - accepted)
    if unknown:
        raise ValueError(
            f"{ckpt_path}: belongs to a different model: its hyperparameters {unknown[:3]} are not "
            f"arguments of {model_class.__name__}"
        )
    if fit and logger_args is not None and "purge_step" in logger_args and logger_args.purge_step is None:
        logger_args.purge_step = checkpoint.get("global_step")
    if fit:
        expect_checkpoints_in(Path(ckpt_path).parent)
    return checkpoint


def expect_checkpoints_in(folder: Path) -> None:
    """Silences ModelCheckpoint's warning that `folder` "exists and is not empty", meant for a new run
    writing among another run's checkpoints, for the folder a fit resumes from (that warning only)."""
    for name in {str(folder), os.path.realpath(folder)}:  # ModelCheckpoint's: as built, or a given dirpath's
        warnings.filterwarnings("ignore", message=re.escape(f"Checkpoint directory {name} exists and is not empty"))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (and dataclasses) as one dict of dotted keys."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = {field.name: getattr(tree, field.name) for field in dataclasses.fields(tree)}
    if not isinstance(tree, dict) or not tree:
        return {prefix.removesuffix("."): tree}
    flat = {}
    for key, value in tree.items():
        flat |= _flatten(value, f"{prefix}{key}.")
    return flat


def check_state_dict(ckpt_path: str, checkpoint: dict[str, Any], model: torch.nn.Module) -> None:
    """Raises ValueError, naming `ckpt_path` and the first differences, unless the checkpoint's state dict
    has exactly `model`'s keys and shapes (what loading it strictly requires)."""
    found = {key: tuple(value.shape) for key, value in checkpoint["state_dict"].items()}
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    differences = [f"{key} missing" for key in expected if key not in found]
    differences += [f"unexpected {key}" for key in found if key not in expected]
    differences += [
        f"{key} {found[key]} where the model has {shape}"
        for key, shape in expected.items()
        if key in found and found[key] != shape
    ]
    if differences:
        more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
        raise ValueError(
            f"{ckpt_path}: belongs to a different model: {'; '.join(differences[:3])}{more}. "
            "Check the config's data and model settings against the run that saved it."
        )


def check_hyperparameters(ckpt_path: str, checkpoint: dict[str, Any], model: LightningModule) -> None:
    """Raises ValueError, naming every differing key with both values, unless the hyperparameters saved in
    the checkpoint equal ``model``'s (those given on the command line and in configs, and the ones linked
    from the data). Keys only one side has (an argument added to the code, or removed, since the
    checkpoint) are not compared. LightningCLI would instead quietly replace the given model arguments
    with the checkpoint's; here they are never replaced."""
    saved = checkpoint.get("hyper_parameters")
    if not saved:
        return
    saved, given = _flatten(dict(saved)), _flatten(dict(model.hparams))
    keys = sorted((saved.keys() & given.keys()) - {"_instantiator", "compile"})  # compile changes no weights
    differ = [
        f"model.{key}: checkpoint {saved[key]!r}, given {given[key]!r}" for key in keys if saved[key] != given[key]
    ]
    if differ:
        raise ValueError(
            f"{ckpt_path}: was saved with other model hyperparameters than the ones given: "
            f"{'; '.join(differ)}. Give the run's own values (its config.yaml holds them all) or start a new run."
        )


def check_run(
    ckpt_path: str,
    checkpoint: dict[str, Any],
    model: LightningModule,
    datamodule: object,
    num_replicas: int | None = None,
) -> None:
    """Raises ValueError, before the run writes anything, unless `checkpoint` fits the built `model`
    (weights and hyperparameters) and, when it resumes training on `num_replicas` ranks, the training
    order of a ResumableDataModule (seed, batch size, ranks)."""
    check_state_dict(ckpt_path, checkpoint, model)
    check_hyperparameters(ckpt_path, checkpoint, model)
    order = checkpoint.get(type(datamodule).__qualname__, {}).get("train_order")
    if num_replicas is not None and order is not None and isinstance(datamodule, ResumableDataModule):
        try:
            datamodule.check_resume(order, num_replicas)
        except ValueError as err:
            raise ValueError(f"{ckpt_path}: {err}") from err


class RunLock(Callback):
    """Holds ``<folder>/.lit_thresh.lock`` (a run directory, or a checkpoint folder: lock_run) from before a
    fit writes anything until it ends, so that a second process resuming the same run (``--ckpt_path
    last``) is refused instead of writing into it too. Taken by the launching process only (rank 0; the
    ranks a DDP launcher starts inherit the run)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._lock = FileLock(self.path, timeout=0)

    def acquire(self) -> None:
        """Takes the lock; ValueError naming the folder when another process holds it."""
        if rank_zero_only.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise ValueError(
                f"{self.path.parent}: another lit_thresh run is writing into this folder (it holds "
                f"{self.path.name}); wait for it to end or stop it, or give this run another folder"
            ) from None

    def release(self) -> None:
        """Gives the lock back (also when the run failed)."""
        self._lock.release(force=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.release()


def run_folders(trainer: Trainer) -> list[Path]:
    """The local folders a fit of `trainer` locks: each folder its checkpoints go to, except that
    checkpoints in a logger's run directory (``<save_dir>/<name>/<version>/checkpoints``, the default)
    lock that run directory, logs included; without checkpoints, the logger's directory (``log_dir``)."""
    folders = []
    for callback in trainer.checkpoint_callbacks:
        folder = str(checkpoint_dir(callback, trainer))
        in_run_dir = callback.dirpath is None and bool(trainer.loggers)
        folders.append(os.path.dirname(folder) if in_run_dir else folder)
    if not folders and trainer.loggers:
        folders.append(str(trainer.log_dir))
    local = {os.path.realpath(folder): Path(folder) for folder in folders if "://" not in folder}
    return list(local.values())  # one per real path: `checkpoint` and `step_checkpoint` share theirs


def lock_run(trainer: Trainer) -> None:
    """Locks the folders a fit of `trainer` writes its checkpoints into (run_folders) until the fit ends
    (RunLock); ValueError naming the folder when another process holds one. In the launching process."""
    if rank_zero_only.rank != 0:
        return
    checkpoint_folders = {os.path.realpath(checkpoint_dir(c, trainer)) for c in trainer.checkpoint_callbacks}
    locks: list[RunLock] = []
    try:
        for folder in run_folders(trainer):
            new = not folder.is_dir() or all(path.name == LOCK_NAME for path in folder.iterdir())
            locks.append(RunLock(folder))
            locks[-1].acquire()
            if new and os.path.realpath(folder) in checkpoint_folders:  # it holds no checkpoints, only the lock
                expect_checkpoints_in(folder)
    except ValueError:
        for lock in locks:
            lock.release()
        raise
    trainer.callbacks.extend(locks)
