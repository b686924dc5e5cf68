"""Checks of a built run that Lightning would only make once the run directory and config.yaml exist:
each raises a ValueError naming the setting, before anything is written."""

import functools
import math
import os
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DistributedSampler


def _check_finite(owner: str, optimizer: torch.optim.Optimizer) -> None:
    """Raises ValueError naming `owner` and the setting when a float setting of an optimizer's parameter
    groups (lr, eps, weight_decay, betas, ...) is NaN or infinite."""
    for group in optimizer.param_groups:
        for key, value in group.items():
            values = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"{owner}: {key} must be finite, got {value}")


def _build(owner: str, build: Any, argument: Any) -> Any:
    """build(argument); its ValueError / TypeError as a ValueError naming `owner`; None for a RuntimeError
    (a device-specific setting, such as a fused optimizer, that the real construction checks)."""
    try:
        return build(argument)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{owner}: {err}") from err
    except RuntimeError:
        return None


def check_optimization(model: LightningModule) -> None:
    """Builds `model`'s ``optimizer`` and ``lr_scheduler`` callables (LanguageModel's) on stand-in
    parameters, in configure_optimizers' two groups, so that their own argument checks (a negative or NaN
    lr, eps, weight decay or betas, a bad warmup, ...) and a non-finite setting or scheduled lr fail now."""
    make_optimizer, make_scheduler = getattr(model, "optimizer", None), getattr(model, "lr_scheduler", None)
    if not callable(make_optimizer):
        return
    weights, biases = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [weights]}, {"params": [biases], "weight_decay": 0.0}]
    optimizer = _build("model.optimizer", make_optimizer, groups)
    if optimizer is None:
        return
    _check_finite("model.optimizer", optimizer)
    if make_scheduler is not None and _build("model.lr_scheduler", make_scheduler, optimizer) is not None:
        _check_finite("model.lr_scheduler", optimizer)  # the lr it starts with


def _set_up_already(datamodule: LightningDataModule, name: str, pid: int, *args: Any, **kwargs: Any) -> None:
    """The DataModule's `name` (``prepare_data`` or ``setup``) as the fit calls it next (_keep_set_up): puts
    the DataModule's own method back and does nothing, as its data are there; in a process other than
    `pid` (a rank spawned with a copy of the DataModule), runs it."""
    del vars(datamodule)[name]
    if os.getpid() != pid:
        getattr(datamodule, name)(*args, **kwargs)


def _keep_set_up(datamodule: LightningDataModule) -> None:
    """Has the next ``prepare_data()`` and ``setup(stage)`` of a DataModule set up for fit already (those
    of the fit Lightning runs next) do nothing: instance attributes shadow both methods until called."""
    for name in ("prepare_data", "setup"):
        setattr(datamodule, name, functools.partial(_set_up_already, datamodule, name, os.getpid()))


def _epoch_batches(trainer: Trainer, datamodule: LightningDataModule) -> int | None:
    """The training batches an epoch of `datamodule` takes on each rank, after ``limit_train_batches``;
    None for a loader without a length. Sets the DataModule up for fit (prepare_data and setup)."""
    datamodule.trainer = trainer  # the ranks a ResumableDataModule's sampler shards over
    try:
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader: Any = datamodule.train_dataloader()
    finally:
        datamodule.trainer = None
    try:
        batches = len(loader)
    except TypeError:
        return None
    if not isinstance(getattr(loader, "sampler", None), DistributedSampler):
        batches = math.ceil(batches / trainer.world_size)  # Lightning shards it over the ranks
    limit = trainer.limit_train_batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def check_val_check_interval(trainer: Trainer, datamodule: LightningDataModule | None) -> None:
    """Raises ValueError when ``trainer.val_check_interval`` is a number of batches longer than an epoch
    (with ``check_val_every_n_epoch`` set, validation would never run). Sets the data up to count its
    batches (in the launching process only), for the fit that follows too: it does not set them up again."""
    interval = trainer.val_check_interval
    counted = isinstance(interval, int) and trainer.check_val_every_n_epoch is not None
    if not counted or datamodule is None or rank_zero_only.rank != 0:
        return
    batches = _epoch_batches(trainer, datamodule)
    if batches is not None and interval > batches:
        raise ValueError(
            f"trainer.val_check_interval ({interval} batches) is longer than an epoch ({batches} training "
            f"batches): give at most {batches}, a fraction of the epoch (e.g. 0.5), or set "
            "trainer.check_val_every_n_epoch to null to count batches across epochs"
        )
    _keep_set_up(datamodule)  # for the fit, which would set the data up again
