"""The one home of the private Lightning (and jsonargparse) names lit_thresh relies on (Lightning 2.6,
pinned ``<2.7`` in pyproject.toml). Each use is a small named function or class here;
tests/test_lightning_compat.py fails, naming the attribute, when a release drops one of them.
"""

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.trainer.states import RunningStage

# (owner, attribute) of every private name used below, checked by tests/test_lightning_compat.py.
PRIVATE_NAMES = [
    ("lightning.pytorch.trainer.trainer.Trainer", "_signal_connector"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_logger_connector"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector", "should_update_logs"),
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "_sigterm_notifier_fn"),
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "received_sigterm"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_broadcast_sigterm_tensor"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_save_topk_checkpoint"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_should_skip_saving_checkpoint"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_monitor_candidates"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_ModelCheckpoint__resolve_ckpt_dir"),  # __resolve_ckpt_dir
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_update"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_t0s"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_lengths"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_samples"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_batches"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_throughputs"),
    ("lightning.pytorch.cli.LightningCLI", "_parse_ckpt_path"),
    ("lightning.pytorch.cli.LightningCLI", "_model_class"),
    ("jsonargparse.ArgumentParser", "_subcommands_action"),  # of the parser LightningCLI gave subcommands
]


def should_update_logs(trainer: Trainer) -> bool:
    """Whether Lightning writes this training batch's logged values to the loggers (every
    ``log_every_n_steps`` stepping batches, and when training stops); valid in ``training_step`` and the
    ``on_train_batch_*`` hooks. Lightning's own test: its arithmetic on the loop's stepping-batch counter
    (not ``global_step``, which differs under gradient accumulation and manual optimization)."""
    return trainer._logger_connector.should_update_logs


def replace_sigterm_handling(
    trainer: Trainer, on_sigterm: Callable[[int, Any], None], before_train_batch: Callable[[], None]
) -> bool:
    """On this trainer only: `on_sigterm` becomes the SIGTERM handler Lightning registers (after the setup
    hooks), and `before_train_batch` replaces the SIGTERM broadcast its training loop runs before every
    batch under DDP. False (nothing changed) if this Lightning handles SIGTERM differently."""
    connector, loop = trainer._signal_connector, trainer.fit_loop.epoch_loop
    if not (hasattr(connector, "_sigterm_notifier_fn") and hasattr(loop, "_broadcast_sigterm_tensor")):
        return False
    connector._sigterm_notifier_fn = on_sigterm  # instance attributes shadow the methods
    loop._broadcast_sigterm_tensor = before_train_batch
    return True


def restore_sigterm_handling(trainer: Trainer) -> None:
    """Undoes replace_sigterm_handling: Lightning's own methods again."""
    vars(trainer._signal_connector).pop("_sigterm_notifier_fn", None)
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


def mark_sigterm(trainer: Trainer) -> None:
    """Sets ``trainer.received_sigterm`` (a read-only property) as Lightning's handler does."""
    trainer._signal_connector.received_sigterm = True


def save_checkpoint_now(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Has `callback` save its checkpoint now (its ``filename``, no monitored metric), unless Lightning
    would skip it: during the sanity check, or when it saved at this step already."""
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_topk_checkpoint(trainer, callback._monitor_candidates(trainer))


def checkpoint_dir(callback: ModelCheckpoint, trainer: Trainer) -> str:
    """The folder `callback` saves into in a fit of `trainer`, as it resolves it when the fit starts: its
    ``dirpath``, else ``<save_dir>/<name>/<version>/checkpoints`` of the first logger, else
    ``<default_root_dir>/checkpoints`` (ModelCheckpoint's ``__resolve_ckpt_dir``)."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)


def add_subcommand(parser: Any, name: str, subparser: Any, help: str) -> None:
    """Adds a subcommand of our own (not a Trainer method) to a parser LightningCLI gave its subcommands:
    jsonargparse's action holding them (``_subcommands_action``), as ``add_subcommands()`` may run once."""
    parser._subcommands_action.add_subcommand(name, subparser, help=help)


def model_class(cli: Any) -> type:
    """The LightningModule class a LightningCLI builds (``model_class``, or LightningModule in subclass mode)."""
    return cli._model_class


class CkptPathCLI(LightningCLI):
    """LightningCLI whose reading of a subcommand's ``ckpt_path``, right after the arguments are parsed and
    before any class is built, is ``read_ckpt_path`` (Lightning's ``_parse_ckpt_path`` replaces the given
    model arguments with the checkpoint's hyperparameters)."""

    def _parse_ckpt_path(self) -> None:
        self.read_ckpt_path()

    def read_ckpt_path(self) -> None:
        """Reads and checks the parsed subcommand's ``ckpt_path`` (``self.config``)."""
        raise NotImplementedError(f"{type(self).__name__} must give its read_ckpt_path")


class LoggedStepSyncThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor, waiting for the GPU only on training batches whose rates are logged
    (and on evaluation batches): its ``_update``, with the ``torch.cuda.synchronize()`` made conditional."""

    @torch.inference_mode()
    def _update(self, trainer: Trainer, pl_module: LightningModule, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        logged = stage != RunningStage.TRAINING or should_update_logs(trainer)
        if logged and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0s[stage]
        self._lengths[stage] += self.length_fn(batch)
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(
            time=elapsed,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage],
            flops=getattr(pl_module, "flops_per_batch", None),
        )
