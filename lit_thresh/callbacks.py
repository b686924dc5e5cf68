"""Callbacks shared by every ``lit_thresh`` run."""

import itertools
import logging
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

log = logging.getLogger(__name__)


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

    Lightning's callback waits for the GPU after every batch, so that the time it records for each is
    exact; that stops the CPU from queueing the next step while the GPU works. Here training batches wait
    only on the steps whose rates are logged. A rate spans the last ``window_size`` batches: its end is
    exact and its start is early by at most the GPU work still queued then (about a step, against the
    ``window_size - 1`` steps it spans).
    """

    def __init__(self, window_size: int = 100) -> None:
        super().__init__(batch_size_fn=batch_size, length_fn=batch_tokens, window_size=window_size)

    @torch.inference_mode()
    def _update(self, trainer: Trainer, pl_module: LightningModule, batch: Any, iter_num: int) -> None:
        """ThroughputMonitor._update, with its synchronisation on logged and evaluation batches only."""
        stage = trainer.state.stage
        logged = stage != RunningStage.TRAINING or trainer._logger_connector.should_update_logs
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
        if trainer._logger_connector.should_update_logs and isinstance(outputs, dict) and "loss" in outputs:
            self._train_loss = {"train/loss": outputs["loss"].item()}  # this rank's
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return super().get_metrics(trainer, pl_module) | self._train_loss


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


class SigtermCheck(Callback):
    """Under DDP, the ranks compare their SIGTERM flags before every `every_n_batches`-th training batch
    and stop together (1: Lightning's own handling, a broadcast before every batch).

    Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training batch under DDP
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a tensor copied to the device, a broadcast, an
    ``.item()``), so each rank's CPU waits for its previous step before it queues the next; its SIGTERM
    handler broadcasts too, to meet the other ranks' next per-batch broadcast. Here a SIGTERM only marks
    the rank that gets it (and, as Lightning's handler does, is passed on to the processes its launcher
    started). Before every n-th training batch (the same batches on every rank: each counts its own, and
    all run the same number) the ranks all-reduce their marks; if any rank was signalled, every rank sets
    ``trainer.received_sigterm`` and raises Lightning's SIGTERMException before that batch. A SIGTERM
    to any rank is thus acted on by all of them together, at most n-1 training batches later (one during
    validation, after it). Lightning PR #21640 (open) proposes the interval as
    ``Trainer(broadcast_sigterm_every_n_steps=...)``. ``checks``: the comparisons made in this run.
    """

    def __init__(self, every_n_batches: int = 10) -> None:
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1:
            raise ValueError(f"every_n_batches must be an int >= 1 (1 = every batch), got {every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self.checks = 0
        self._signalled = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.checks, self._signalled = 0, False
        if stage != "fit" or self.every_n_batches == 1 or trainer.world_size == 1:
            return
        connector, loop = trainer._signal_connector, trainer.fit_loop.epoch_loop
        if not (hasattr(connector, "_sigterm_notifier_fn") and hasattr(loop, "_broadcast_sigterm_tensor")):
            rank_zero_warn("SigtermCheck: this Lightning handles SIGTERM differently; left as it is")
            return
        batches = itertools.count()

        def on_sigterm(signum: int, frame: Any) -> None:
            log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}")
            if not self._signalled and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)  # the other ranks, if this process started them
            self._signalled = True

        def compare_flags() -> None:
            if next(batches) % self.every_n_batches:
                return
            self.checks += 1
            flag = torch.tensor([int(self._signalled)], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item():
                connector.received_sigterm = True
                raise SIGTERMException

        # Instance attributes shadow Lightning's methods on this trainer only; Lightning registers its
        # SIGTERM handler (connector._sigterm_notifier_fn) after the setup hooks.
        connector._sigterm_notifier_fn = on_sigterm
        loop._broadcast_sigterm_tensor = compare_flags

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        vars(trainer._signal_connector).pop("_sigterm_notifier_fn", None)
        vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


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

    Each step's check runs after the backward pass, before gradient clipping and the optimizer step: one
    foreach norm of the gradients (under DDP, and one all-reduce so that every rank stops). ``deferred``:
    False reads its result at once, so the error comes before that optimizer step; True copies it to the
    host without waiting and reads it one step later, so the CPU does not wait for the GPU: the bad step's
    update then reaches the weights in memory (and a validation right after it may log NaN), but every
    checkpoint save and the end of training read the pending check first, so no checkpoint is written
    after a non-finite step. None (default): deferred on CUDA, unless a checkpoint callback saves weights
    only (Lightning then skips callbacks' ``on_save_checkpoint``, which reads the pending check).
    """

    def __init__(self, deferred: bool | None = None) -> None:
        self.deferred = deferred
        self._deferred = False  # the choice for this run, see setup
        self._losses: list[torch.Tensor] = []  # the step's (micro-batch) losses
        self._batch_idx = 0
        self._pending: _Check | None = None  # the last step's check, not read yet

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        weights_only = any(callback.save_weights_only for callback in trainer.checkpoint_callbacks)
        if self.deferred and weights_only:
            raise ValueError(
                "NaNGuard(deferred=True) cannot guard checkpoints saved with save_weights_only=True: Lightning "
                "skips callbacks' on_save_checkpoint for them; use deferred=False or None"
            )
        auto = trainer.strategy.root_device.type == "cuda" and not weights_only
        self._deferred = auto if self.deferred is None else self.deferred

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        self._read_pending()
        losses = torch.stack(self._losses).float() if self._losses else torch.zeros(0, device=pl_module.device)
        self._losses.clear()  # losses: (micro-batches,), scaled by the GradScaler if there is one
        grads = {p: p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            grads = {}  # inf gradients are the GradScaler's business
        norms = torch.stack(torch._foreach_norm(list(grads.values()))) if grads else losses.new_zeros(0)  # (P,)
        where = f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {self._batch_idx})"
        check = _Check(losses, norms, list(grads), pl_module, where)
        if self._deferred:
            self._pending = check.start_copy()
        else:
            check.read(deferred=False)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._read_pending()  # before anything is written

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_pending()

    def _read_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.read(deferred=True)


class _Check:
    """One step's NaNGuard check: its losses (micro-batches,), the gradient norms (P,) of `params` (of
    `module`, which names them in the error), and where it ran."""

    def __init__(
        self, losses: torch.Tensor, norms: torch.Tensor, params: list[torch.Tensor], module: torch.nn.Module, where: str
    ) -> None:
        self.losses, self.norms, self.params, self.module, self.where = losses, norms, params, module, where
        ok = (losses.isfinite().all() & norms.isfinite().all()).int()  # 0-d, on the device
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)  # one rank's bad loss stops all
        self.ok = ok
        self.done: torch.cuda.Event | None = None

    def start_copy(self) -> "_Check":
        """Starts copying the result to the host, without waiting for the device."""
        if self.ok.is_cuda:
            host = torch.empty((), dtype=self.ok.dtype, pin_memory=True)
            self.ok = host.copy_(self.ok, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        return self

    def read(self, deferred: bool) -> None:
        """Raises the FloatingPointError if the step was not finite (waits for the copy first)."""
        if self.done is not None:
            self.done.synchronize()
        if bool(self.ok):
            return
        loss_text = ", ".join(f"{v:.6g}" for v in self.losses.tolist())
        if not bool(self.losses.isfinite().all()):
            problem = f"non-finite training loss {loss_text} {self.where}"
        elif bool(self.norms.isfinite().all()):
            problem = f"non-finite training loss on another rank {self.where}"
        else:
            names = {p: name for name, p in self.module.named_parameters()}
            finite = self.norms.isfinite().tolist()
            bad = [names.get(p, "?") for p, ok in zip(self.params, finite, strict=True) if not ok]
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            problem = f"non-finite gradients of {', '.join(bad[:3])}{more} {self.where} (loss {loss_text})"
        if deferred:
            raise FloatingPointError(
                f"{problem}: training stopped at the next check, and no checkpoint was written after this step, "
                "so the last checkpoint is from before it"
            )
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
