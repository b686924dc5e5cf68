"""Callbacks that keep a run safe: SIGTERM handling, RNG state, NaN guard, step checkpoints."""

import itertools
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lit_thresh.lightning_compat import (
    mark_sigterm,
    replace_sigterm_handling,
    restore_sigterm_handling,
    save_checkpoint_now,
)

log = logging.getLogger(__name__)


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
                mark_sigterm(trainer)
                raise SIGTERMException

        if not replace_sigterm_handling(trainer, on_sigterm, compare_flags):  # on this trainer only
            rank_zero_warn("SigtermCheck: this Lightning handles SIGTERM differently; left as it is")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        restore_sigterm_handling(trainer)


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
        self._read_pending(trainer)
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
            check.read(trainer, deferred=False)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._read_pending(trainer)  # before anything is written

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_pending(trainer)

    def _read_pending(self, trainer: Trainer) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.read(trainer, deferred=True)


def latest_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint file this run wrote (its checkpoint callbacks') or resumed from, if any."""
    paths = {trainer.ckpt_path}
    for callback in trainer.checkpoint_callbacks:
        paths |= {callback.best_model_path, callback.last_model_path}
    files = [Path(path) for path in paths if path and Path(path).is_file()]
    return str(max(files, key=lambda path: path.stat().st_mtime)) if files else None


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

    def read(self, trainer: Trainer, deferred: bool) -> None:
        """Raises the FloatingPointError if the step was not finite (waits for the copy first); it names
        `trainer`'s latest checkpoint, or says that there is none."""
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
        latest = latest_checkpoint(trainer)
        if deferred:
            before = f"so the last checkpoint, {latest}, is from before it" if latest else "nor before it"
            raise FloatingPointError(
                f"{problem}: training stopped at the next check, and no checkpoint was written after this step, "
                f"{before}"
            )
        before = f"and the last checkpoint, {latest}, are" if latest else "are (no checkpoint was written)"
        raise FloatingPointError(
            f"{problem}: training stopped before this optimizer step, so the weights {before} from before it"
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
        self.every_n_steps = every_n_train_steps
        self._saved: tuple[int, list[tuple[str, str]]] | None = None  # (step, _others) at the last save

    @staticmethod
    def _others(trainer: Trainer) -> list[tuple[str, str]]:
        """The files the other checkpoint callbacks last wrote (their state that last.ckpt records)."""
        return [
            (callback.best_model_path, callback.last_model_path)
            for callback in trainer.checkpoint_callbacks
            if not isinstance(callback, StepCheckpoint)
        ]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # every_n_train_steps' save
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0 and not trainer.sanity_checking:
            self._saved = (trainer.global_step, self._others(trainer))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_last_now(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_last_now(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":  # stopped between steps
            self._save_last_now(trainer)  # resumable: --ckpt_path last

    def _save_last_now(self, trainer: Trainer) -> None:
        """Saves last.ckpt unless it already holds this step's state: saved at this step, and the other
        checkpoint callbacks (which save after validation and at the epoch's end, before this one) have
        written nothing since. Otherwise a step save right before a new best would leave last.ckpt naming a
        best checkpoint that is deleted by then, and a resume from it would keep two best files."""
        if trainer.sanity_checking:
            return
        state = (trainer.global_step, self._others(trainer))
        if state == self._saved:
            return
        if self._saved is not None and self._saved[0] == trainer.global_step:
            trainer.save_checkpoint(self.best_model_path, self.save_weights_only)  # again, the others' new state
        else:
            save_checkpoint_now(self, trainer)
        self._saved = state
