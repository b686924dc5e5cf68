"""Callbacks that measure and report a run: HPARAMS with final metrics, throughput, progress, memory."""

import datetime
import math
import os
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from rich import get_console
from rich.console import Console
from rich.table import Table

from lit_thresh.lightning_compat import LoggedStepSyncThroughputMonitor, should_update_logs

# Optimizer and scheduler arguments that choose an implementation, not a result: left out of HPARAMS.
OPTIMIZER_INTERNALS = {"foreach", "fused", "capturable", "differentiable", "maximize", "last_epoch"}


def hparams_for_tensorboard(hparams: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """`hparams` (model and data, nested) as flat ``a/b`` names for TensorBoard's HPARAMS tab: without
    the names LightningCLI adds (``_instantiator``, ``_class_path``), the model's ``config/`` and every
    ``init_args/`` level, and the optimizer's and scheduler's OPTIMIZER_INTERNALS; with ``seed_everything``."""
    flat: dict[str, Any] = {}

    def add(prefix: str, value: Any, top: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                key = str(key)
                if key.startswith("_") or (top in ("optimizer", "lr_scheduler") and key in OPTIMIZER_INTERNALS):
                    continue
                skip = key == "init_args" or (not prefix and key == "config")
                add(prefix if skip else f"{prefix}{key}/", item, top or key)
        else:
            flat[prefix.rstrip("/")] = value

    add("", dict(hparams), "")
    if seed is not None:
        flat["seed_everything"] = seed
    return flat


class HparamsWithMetrics(Callback):
    """Fill TensorBoard's HPARAMS tab: at the end of fit and test, log the run's hyperparameters
    (hparams_for_tensorboard: readable names, no internals, the seed) with its final metrics
    (``trainer.callback_metrics``); at the end of fit, print those metrics.

    Meant for ``TensorBoardLogger(default_hp_metric=False)``, which records the hyperparameters at start
    but writes no HPARAMS entry until it is given metrics.
    """

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self._log(trainer)
        rank_zero_info("Final metrics: " + ", ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items())))

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)  # MetricsTable prints them

    @staticmethod
    def _log(trainer: Trainer) -> dict[str, float]:
        metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
        seed = os.environ.get("PL_GLOBAL_SEED")  # set by seed_everything
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                kept = dict(logger.hparams)  # a copy (log_hyperparams updates the logger's dict in place):
                # hparams.yaml keeps the full, nested hyperparameters
                hparams = hparams_for_tensorboard(kept, seed and int(seed))
                logger.log_hyperparams(hparams, metrics, step=trainer.global_step)
                logger.hparams = kept
        return metrics


class MetricsTable(Callback):
    """At the end of ``test`` and ``validate``, prints the metrics as one table: a row per metric (``acc``,
    ``loss``, ...), a column per data set (``test`` for the first, then e.g. ``len128_n16``): instead of
    Lightning's table per DataLoader (the CLI runs them with ``verbose=False``)."""

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.print_table(trainer, "test")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.print_table(trainer, "val")

    @staticmethod
    @rank_zero_only
    def print_table(trainer: Trainer, split: str) -> None:
        """Prints the `split` metrics of trainer.callback_metrics (names ``split[/set]/metric``)."""
        values: dict[str, dict[str, float]] = {}  # metric -> data set -> value
        sets: list[str] = []
        for name, value in trainer.callback_metrics.items():
            if name.split("/")[0] != split or "/" not in name:
                continue
            data_set, metric = name.rsplit("/", 1)
            data_set = data_set.removeprefix(f"{split}/") if data_set != split else split
            sets += [data_set] if data_set not in sets else []
            values.setdefault(metric, {})[data_set] = value.item()
        if not values:
            return
        sets.sort(key=lambda name: name != split)  # the first data set, then the DataModule's order
        table = Table(title=f"{split} metrics", header_style="bold")
        table.add_column("metric")
        for data_set in sets:
            table.add_column(data_set, justify="right")
        for metric, row in sorted(values.items()):
            table.add_row(metric, *(f"{row[s]:.4g}" if s in row else "" for s in sets))
        Console(width=max(80, 12 + 14 * len(sets))).print(table)


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a batch of `input_ids` (B, T)."""
    return batch["input_ids"].shape[0]


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch of `input_ids` (B, T)."""
    return batch["input_ids"].numel()


class TokenThroughput(LoggedStepSyncThroughputMonitor):
    """Lightning's ThroughputMonitor for ``{"input_ids": (B, T)}`` batches: logs, every
    ``log_every_n_steps`` once ``window_size`` batches have run, ``train/device/batches_per_sec``,
    ``train/device/items_per_sec`` (tokens/s of one device; ``train/items_per_sec`` over all devices
    under DDP) and, with the model's ``flops_per_batch``, ``train/device/mfu`` on known GPUs.
    Validation time is left out of the training rates.

    Lightning's callback waits for the GPU after every batch, so that the time it records for each is
    exact; that stops the CPU from queueing the next step while the GPU works. Here training batches wait
    only on the steps whose rates are logged. A rate spans the last ``window_size`` batches: its end is
    exact and its start is early by at most the GPU work still queued then (about a step, against the
    ``window_size - 1`` steps it spans).
    """

    def __init__(self, window_size: int = 100) -> None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size must be an int >= 2 (batches a rate spans), got {window_size!r}")
        super().__init__(batch_size_fn=batch_size, length_fn=batch_tokens, window_size=window_size)


class TrainLossProgressBar(RichProgressBar):
    """Lightning's RichProgressBar, plus the training loss of the last step written to the loggers (every
    ``log_every_n_steps``), read back from the GPU then only: a ``prog_bar=True`` value would be read
    back every step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._train_loss: dict[str, float] = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if should_update_logs(trainer) and isinstance(outputs, dict) and "loss" in outputs:
            self._train_loss = {"train/loss": outputs["loss"].item()}  # this rank's
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module) | self._train_loss
        metrics.pop("v_num", None)  # the run directory's version: in its path already
        return metrics


class PeakMemory(Callback):
    """Logs ``perf/peak_memory_gib``: the peak memory allocated by torch on the GPU (max over ranks)
    at the end of each training epoch and validation; nothing on CPU."""

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._log(pl_module)

    @staticmethod
    def _log(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            pl_module.log("perf/peak_memory_gib", peak, reduce_fx="max", sync_dist=True)


class ModelSummaryTable(RichModelSummary):
    """Lightning's RichModelSummary, without its FLOPs column and ``Total FLOPs: 0`` when it counted none
    (it counts them only for a model with an ``example_input_array``)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                total_flops, **summarize_kwargs,
            )  # fmt: skip
            return
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        for name, _ in columns:
            justify = "right" if name == "Params" else "left"
            table.add_column(name, justify=justify, style="dim" if name == " " else None)
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        console.print(
            f"[bold]Params[/]: {get_human_readable_count(trainable_parameters).strip()} trainable, "
            f"{get_human_readable_count(total_parameters - trainable_parameters).strip()} frozen, "
            f"{get_formatted_model_size(model_size)} MB; modules in train mode: {total_training_modes['train']}, "
            f"eval mode: {total_training_modes['eval']}"
        )


class ProgressLog(Callback):
    """Off a terminal (stdout not a TTY: SLURM, nohup, CI, a pipe), logs a plain line every
    `every_n_steps` optimizer steps: step, epoch, training loss, tokens/s (all devices, since the last
    line) and the estimated time left; a progress bar there writes nothing readable. On a terminal it
    stays quiet (the progress bar shows the same), unless `always`."""

    def __init__(self, every_n_steps: int = 50, always: bool = False) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.every_n_steps, self.always = every_n_steps, always
        self.lines: list[str] = []  # what this run logged
        self._active = False
        self._since: tuple[float, int] = (0.0, 0)  # (time, step) of the last line
        self._tokens = 0  # this rank's, since the last line

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._active = self.always or not sys.stdout.isatty()
        self._since, self._tokens = (time.perf_counter(), trainer.global_step), 0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._tokens += batch_tokens(batch) if isinstance(batch, dict) and "input_ids" in batch else 0
        step, (then, then_step) = trainer.global_step, self._since
        if step == then_step or step % self.every_n_steps:
            return
        now = time.perf_counter()
        seconds_per_step = (now - then) / (step - then_step)
        parts = [f"step {step}", f"epoch {trainer.current_epoch}"]
        if isinstance(outputs, dict) and "loss" in outputs:
            parts.append(f"loss {outputs['loss'].item():.4f}")  # this rank's; read back on these steps only
        parts.append(f"{self._tokens * trainer.world_size / (now - then):,.0f} tokens/s")
        total = trainer.estimated_stepping_batches
        if math.isfinite(total):
            parts[0] += f"/{int(total)}"
            parts.append(f"ETA {datetime.timedelta(seconds=round(max(total - step, 0) * seconds_per_step))}")
        self._since, self._tokens = (now, step), 0
        self.lines.append(" | ".join(parts))
        rank_zero_info(self.lines[-1])
