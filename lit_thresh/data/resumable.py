"""A training order that is a function of (seed, epoch) and that a checkpoint resumes mid-epoch."""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# The sampler settings a saved position is only valid for.
_ORDER_KEYS = ("seed", "batch_size", "num_samples", "num_replicas")


def check_order_settings(saved: dict[str, int], current: dict[str, int]) -> None:
    """Raises ValueError naming every order setting (of those both give) that differs from the saved one."""
    keys = [key for key in _ORDER_KEYS if key in saved and key in current]
    changed = [f"{key} {saved[key]} -> {current[key]}" for key in keys if saved[key] != current[key]]
    if changed:
        raise ValueError(
            "cannot resume the training order: the data settings differ from the checkpoint's "
            f"({', '.join(changed)}); resume with the run's own data settings"
        )


def seeded_loader(dataset: Dataset, batch_size: int, seed: int, **loader_kwargs: Any) -> DataLoader:
    """A DataLoader with its own generator, seeded by ``seed``: creating its iterators leaves the global
    RNG (the model's, e.g. dropout) alone. Keyword arguments, so that Lightning can re-create it (predict)."""
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(seed), **loader_kwargs)


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (a shuffle drawn from ``seed + epoch``, sharded over ``num_replicas``
    ranks) that can start an epoch after its first ``batches_done`` batches.

    Lightning's ``set_epoch`` before every epoch picks the order, and a new epoch resets ``batches_done``;
    being a DistributedSampler, it is not replaced under DDP. Its length stays the full epoch's, as
    Lightning counts the batches already done itself.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, *, seed: int = 0, num_replicas: int = 1, rank: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.batches_done = 0  # batches of this epoch already trained on, by this rank

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.batches_done = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())  # (num_samples,) this rank's order for the epoch
        return iter(indices[self.batches_done * self.batch_size :])

    def state_dict(self) -> dict[str, int]:
        """The position (epoch, batches done) and the settings it is valid for."""
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_samples": len(self.dataset),
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues at a saved position; raises ValueError naming the settings that changed since."""
        check_order_settings(state, self.state_dict())
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`ResumableSampler` whose position Lightning keeps in checkpoints: having
    ``state_dict`` / ``load_state_dict``, it is a resumable loader to Lightning's fit loop, which saves its
    state with the loop's and loads it into the loader before a resumed run's first batch.

    ``epoch_batches``: the batches an epoch takes (default: its length); a position at or past it is saved
    as the start of the next epoch.
    """

    epoch_batches: Callable[[], int | float] | None = None

    def state_dict(self) -> dict[str, Any]:
        order = self.sampler.state_dict()
        epoch_batches = self.epoch_batches() if self.epoch_batches is not None else len(self)
        if order["batches_done"] >= epoch_batches:  # the epoch is over: resume at the next
            order |= {"epoch": order["epoch"] + 1, "batches_done": 0}
        return {"train_order": order}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict["train_order"])


class ResumableDataModule(LightningDataModule):
    """A LightningDataModule whose training order is a :class:`ResumableSampler` kept in checkpoints.

    ``resumable_loader`` builds the training DataLoader (a :class:`ResumableLoader`). The DataModule
    counts the training batches the loop takes (``on_before_batch_transfer``: Lightning's one-batch
    prefetch is not counted) and the loader's state, saved in every checkpoint, holds the position, so a
    run resumed mid-epoch gets the batches an uninterrupted run would have had next. DataLoaders should
    carry their own ``generator`` so that creating their iterators does not draw from the global RNG
    (which then feeds only the model, e.g. dropout).
    """

    train_sampler: ResumableSampler | None = None
    _train_loader: ResumableLoader | None = None
    _saved_order: dict[str, Any] | None = None  # a checkpoint's loader state, for the next resumable_loader

    def resumable_loader(
        self, dataset: Dataset, batch_size: int, seed: int, **loader_kwargs: Any
    ) -> ResumableLoader:
        """A training DataLoader over ``dataset`` in the order of ``seed``, at a loaded checkpoint's position."""
        ranks = (self.trainer.distributed_sampler_kwargs if self.trainer else None) or {}
        sampler = ResumableSampler(dataset, batch_size, seed=seed, **ranks)
        if loader_kwargs.get("drop_last") and sampler.num_samples < batch_size:
            raise ValueError(
                f"batch_size {batch_size} is larger than the training set ({sampler.num_samples} "
                f"examples{' per rank' if sampler.num_replicas > 1 else ''}): not one whole batch; "
                "lower batch_size or give more training examples"
            )
        self.train_sampler = sampler
        generator = torch.Generator().manual_seed(seed)
        loader = ResumableLoader(
            dataset, batch_size=batch_size, generator=generator, sampler=self.train_sampler, **loader_kwargs
        )
        if self.trainer is not None:
            loader.epoch_batches = lambda: self.trainer.num_training_batches
        if self._saved_order is not None:
            loader.load_state_dict(self._saved_order)
            self._saved_order = None
        self._train_loader = loader
        return loader

    def order_settings(self) -> dict[str, int]:
        """The settings of the training order known before ``setup``: ``seed`` and ``batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} must give its order_settings")

    def check_resume(self, saved_order: dict[str, int], num_replicas: int) -> None:
        """Raises ValueError, before anything runs, when a checkpoint's training order (``saved_order``: the
        ``train_order`` of this DataModule's state in it) was made with another seed, batch size or ranks."""
        check_order_settings(saved_order, self.order_settings() | {"num_replicas": num_replicas})

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training and self.train_sampler is not None:
            self.train_sampler.batches_done += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training loader's state, also kept here: Lightning loads the DataModule's state before a
        model's configure_optimizers may build the loader (``estimated_stepping_batches``), and the
        loader's own state only after, into a loader built already."""
        return self._train_loader.state_dict() if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_order = state_dict if "train_order" in state_dict else None
