"""Resuming a run with ``--ckpt_path last``: find the run it continues and log into that run's directory, and
refuse a checkpoint whose model hyperparameters differ from the ones given."""

from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_thresh.data.resumable import ResumableDataModule

LAST = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION  # last.ckpt


def _read(ckpt_path: str) -> dict[str, Any]:
    """A checkpoint, its tensors memory-mapped rather than read."""
    return torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)


def latest_run(root: Path) -> Path | None:
    """The ``root/version_*`` run directory whose ``checkpoints/last.ckpt`` was written last, if any."""
    runs = [run for run in root.glob("version_*") if (run / "checkpoints" / LAST).is_file()]
    return max(runs, key=lambda run: (run / "checkpoints" / LAST).stat().st_mtime, default=None)


def resolve_last(config: Namespace, fit: bool = True) -> None:
    """Turns a subcommand config's ``ckpt_path: last`` into the path of the checkpoint it resumes.

    With the default checkpoint folder, that is the newest ``last.ckpt`` among the logger's runs
    (``<save_dir>/<name>/version_N``), and the logger's ``version`` is set to N (unless given), so the
    resumed run writes into the same directory instead of a new ``version_N``; when resuming ``fit``, a
    TensorBoardLogger's ``purge_step`` is set to the checkpoint's step, so TensorBoard hides what the
    interrupted run logged after its checkpoint (the resumed run logs those steps again). `validate`,
    `test` and `predict` (fit=False) log into the same directory and hide nothing. With ``checkpoint.dirpath``
    set, it is ``<dirpath>/last.ckpt``. Without any ``last.ckpt``, ``last`` stays, and Lightning starts the
    run from scratch with a warning: the same command starts a run and resumes it.
    """
    if config.get("ckpt_path") != "last":
        return
    dirpath = config.get("checkpoint.dirpath")
    if dirpath is not None:
        if (Path(dirpath) / LAST).is_file():
            config.ckpt_path = str(Path(dirpath) / LAST)
        return
    logger = config.get("trainer.logger")
    args = logger.get("init_args") if isinstance(logger, Namespace) else None
    if args is None or not {"save_dir", "name", "version"} <= set(vars(args)):
        return  # no logger, or one that does not write <save_dir>/<name>/version_N
    run = latest_run(Path(args.save_dir or ".") / (args.name or ""))
    if run is None:
        return
    config.ckpt_path = str(run / "checkpoints" / LAST)
    if args.version is None:
        version = run.name.removeprefix("version_")
        args.version = int(version) if version.isdigit() else version
        if fit and "purge_step" in args and args.purge_step is None:
            args.purge_step = _read(config.ckpt_path)["global_step"]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_hyperparameters(ckpt_path: str, checkpoint: dict[str, Any], model: LightningModule) -> None:
    """Raises ValueError, naming every differing key with both values, unless the hyperparameters saved in
    ``checkpoint`` (read from ``ckpt_path``) equal ``model``'s (those given on the command line and in
    configs, and the ones linked from the data). Keys only one side has (an argument added to the code, or
    removed, since the checkpoint) are not compared. LightningCLI would instead quietly replace the given
    model arguments with the checkpoint's; here they are never replaced."""
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
            f"ckpt_path {ckpt_path} was saved with other model hyperparameters than the ones given: "
            f"{'; '.join(differ)}. Give the run's own values (its config.yaml holds them all) or start a new run."
        )


def check_data_order(checkpoint: dict[str, Any], datamodule: object, num_replicas: int) -> None:
    """Before a run resumes from ``checkpoint`` (and writes anything), raises ValueError when its training
    order was made with another data seed, batch size or number of ranks (ResumableDataModule)."""
    if isinstance(datamodule, ResumableDataModule):
        datamodule.check_resume(checkpoint.get(type(datamodule).__qualname__, {}), num_replicas)
