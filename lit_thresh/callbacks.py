"""Callbacks shared by every ``lit_thresh`` run."""

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer


class HparamsWithMetrics(Callback):
    """Fill TensorBoard's HPARAMS tab: at the end of fit and test, log the run's hyperparameters with its
    final metrics (``trainer.callback_metrics``), and print those metrics.

    Meant for ``TensorBoardLogger(default_hp_metric=False)``, which records the hyperparameters at start
    but writes no HPARAMS entry until it is given metrics.
    """

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)

    @staticmethod
    def _log(trainer: Trainer) -> None:
        metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
        rank_zero_info("Final metrics: " + ", ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items())))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(logger.hparams, metrics, step=trainer.global_step)


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a batch of `input_ids` (B, T)."""
    return batch["input_ids"].shape[0]


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch of `input_ids` (B, T)."""
    return batch["input_ids"].numel()


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for ``{"input_ids": (B, T)}`` batches: logs, every
    ``log_every_n_steps`` once ``window_size`` batches have run, ``train/device/batches_per_sec``,
    ``train/device/items_per_sec`` (tokens/s of one device; ``train/items_per_sec`` over all devices
    under DDP) and, with the model's ``flops_per_batch``, ``train/device/mfu`` on known GPUs.
    Validation time is left out of the training rates.
    """

    def __init__(self, window_size: int = 100) -> None:
        super().__init__(batch_size_fn=batch_size, length_fn=batch_tokens, window_size=window_size)


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


class RNGState(Callback):
    """Keeps torch's random number generators (CPU and CUDA) in every checkpoint and puts them back just
    before the first training batch after a resume, so dropout draws the masks of an uninterrupted run.

    Exact when only the model draws from the global generators: lit_thresh's DataLoaders carry their own
    (``ResumableDataModule``). Every DDP rank restores the saved (rank 0's) states, the CUDA one onto its
    own device; ``seed_everything`` gives every rank the same seed, so their states agree anyway.
    """

    def __init__(self) -> None:
        self._saved: dict | None = None

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (rank 0's: it saves)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved = state_dict

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._saved is None:
            return
        torch.set_rng_state(self._saved["cpu"])
        if "cuda" in self._saved and pl_module.device.type == "cuda":
            torch.cuda.set_rng_state(self._saved["cuda"], pl_module.device)
        self._saved = None


class NaNGuard(Callback):
    """Stops training with a FloatingPointError naming the global step when a training loss, or (without
    a GradScaler, which skips such steps itself) a gradient, is NaN or infinite.

    The check runs after the backward pass and before the optimizer step (and before gradient clipping),
    so the weights are never updated with non-finite values, and as the error ends the run without a
    save, the last checkpoint is the last one written before that step. One device sync per step.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []  # the step's (micro-batch) losses
        self._batch_idx = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        losses = torch.stack(self._losses).float() if self._losses else torch.zeros(0, device=pl_module.device)
        self._losses.clear()  # losses: (micro-batches,)
        grads = {p: p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            grads = {}  # inf gradients are the GradScaler's business
            losses = losses / scaler.get_scale()  # the hook saw the scaled loss
        grad_norm = torch.nn.utils.get_total_norm(list(grads.values())) if grads else losses.new_zeros(())
        if bool(losses.isfinite().all() & grad_norm.isfinite()):  # one foreach norm, one sync
            return
        loss_text = ", ".join(f"{v:.6g}" for v in losses.tolist())
        where = f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {self._batch_idx})"
        if not bool(losses.isfinite().all()):
            problem = f"non-finite training loss {loss_text} {where}"
        else:
            names = {p: name for name, p in pl_module.named_parameters()}
            bad = [names.get(p, "?") for p, g in grads.items() if not bool(g.isfinite().all())]
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            problem = f"non-finite gradients of {', '.join(bad[:3])}{more} {where} (loss {loss_text})"
        raise FloatingPointError(
            f"{problem}: training stopped before this optimizer step, so the weights and the last checkpoint "
            "are from before it"
        )


class StepCheckpoint(ModelCheckpoint):
    """Writes ``last.ckpt`` every ``every_n_train_steps`` optimizer steps (0: never), after every
    validation and at the end of every training epoch, so that a crash loses at most that many steps and
    ``--ckpt_path last`` always means the latest state. (Lightning's own ``save_last`` rewrites it only
    when a new best checkpoint is saved.) The best checkpoints are another ModelCheckpoint's business.
    ``dirpath``: default, the logger's ``<log_dir>/checkpoints``.
    """

    def __init__(self, every_n_train_steps: int = 500, dirpath: str | None = None) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0 (0: off), got {every_n_train_steps}")
        super().__init__(
            dirpath=dirpath,
            filename=ModelCheckpoint.CHECKPOINT_NAME_LAST,  # the one file it keeps: last.ckpt
            monitor=None,
            save_top_k=1,
            every_n_train_steps=every_n_train_steps,
            enable_version_counter=False,  # overwrite last.ckpt, whoever wrote it
        )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_last_now(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_last_now(trainer)

    def _save_last_now(self, trainer: Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # sanity check, or saved at this step already
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
