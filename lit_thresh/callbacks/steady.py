"""A steady host during training: Python's garbage collector runs at fixed steps, the same on every rank."""

import gc
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_thresh.lightning_compat import should_update_logs


class SteadyHost(Callback):
    """Runs Python's garbage collector every `every_n_steps` training steps instead of whenever allocations
    cross its thresholds, and logs the time it spends collecting as ``perf/gc_ms``.

    Left to itself, the collector starts a full (generation 2) collection at a moment no one chooses, and
    a full collection walks every object the process tracks: hundreds of thousands (the libraries', then
    torch.compile's graphs and guards; about 0.7 s on a CPU, docs/ddp.md). Under DDP each rank pauses at its own moment and the other
    ranks wait for it in the next all-reduce, so every rank's pauses slow them all. Here, when training
    starts, a full collection runs and the survivors are frozen (``gc.freeze``: no later collection walks
    them), and automatic collection is switched off; then every `every_n_steps` steps (after the same step
    on every rank, as Megatron-LM's ``--manual-gc`` and torchtitan do) a full collection runs and its
    survivors are frozen too, so that each collection walks only the objects made since the last one.
    Objects frozen while in use that later become unreachable in a reference cycle are not freed during
    training (those freed by reference counting, nearly all, are). When training ends, or fails, the frozen
    objects are unfrozen and automatic collection is back as it was.

    ``perf/gc_ms``: milliseconds this rank spent in garbage collection since the last logged step (max over
    ranks), on the steps the loggers write; with `every_n_steps` 0 it times Python's automatic collections
    and changes nothing.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps must be an int >= 0 (0: automatic collection, timed), got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.collections = 0  # full collections this callback ran in this fit
        self._collected_at = -1  # the global step of the last one (a step of several batches collects once)
        self._collecting_ms = 0.0  # time in collections since the last logged step
        self._started: float | None = None  # perf_counter at the start of the running collection
        self._was_enabled: bool | None = None  # gc.isenabled() before training; None: nothing changed

    def _time(self, phase: str, info: dict[str, Any]) -> None:
        """gc.callbacks entry: adds each collection's duration to _collecting_ms."""
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._collecting_ms += 1000.0 * (time.perf_counter() - self._started)
            self._started = None

    def _collect_and_freeze(self, step: int) -> None:
        gc.collect()
        gc.freeze()
        self.collections, self._collected_at = self.collections + 1, step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collections, self._collecting_ms = 0, 0.0
        if self._time not in gc.callbacks:
            gc.callbacks.append(self._time)
        if self.every_n_steps:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect_and_freeze(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self._collected_at:
            self._collect_and_freeze(step)
        if should_update_logs(trainer):
            pl_module.log("perf/gc_ms", self._collecting_ms, on_step=True, on_epoch=False, reduce_fx="max", sync_dist=True)
            self._collecting_ms = 0.0

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()  # Lightning skips teardown when a fit fails

    def _restore(self) -> None:
        """Python's collector as it was before training; nothing to do when nothing changed."""
        if self._time in gc.callbacks:
            gc.callbacks.remove(self._time)
        if self._was_enabled is not None:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None
