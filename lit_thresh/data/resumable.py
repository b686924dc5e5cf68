"""A training order that is a function of (seed, epoch) and that a checkpoint resumes mid-epoch."""

from collections.abc import Iterator
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


class ResumableDataModule(LightningDataModule):
    """A LightningDataModule whose training order is a :class:`ResumableSampler` kept in checkpoints.

    ``resumable_loader`` builds the training DataLoader. The DataModule counts the training batches the
    loop takes (``on_before_batch_transfer``: Lightning's one-batch prefetch is not counted) and saves the
    position in every checkpoint, so a run resumed mid-epoch gets the batches an uninterrupted run would
    have had next. DataLoaders should carry their own ``generator`` so that creating their iterators
    does not draw from the global RNG (which then feeds only the model, e.g. dropout).
    """

    train_sampler: ResumableSampler | None = None
    _saved_order: dict[str, int] | None = None

    def resumable_loader(self, dataset: Dataset, batch_size: int, seed: int, **loader_kwargs: Any) -> DataLoader:
        """A training DataLoader over ``dataset`` in the order of ``seed``, at the checkpoint's position."""
        ranks = (self.trainer.distributed_sampler_kwargs if self.trainer else None) or {}
        self.train_sampler = ResumableSampler(dataset, batch_size, seed=seed, **ranks)
        if self._saved_order is not None:
            self.train_sampler.load_state_dict(self._saved_order)
            self._saved_order = None
        return seeded_loader(dataset, batch_size, seed, sampler=self.train_sampler, **loader_kwargs)

    def order_settings(self) -> dict[str, int]:
        """The settings of the training order known before ``setup``: ``seed`` and ``batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} must give its order_settings")

    def check_resume(self, saved_state: dict[str, Any], num_replicas: int) -> None:
        """Raises ValueError, before anything runs, when the checkpoint's training order (``saved_state``:
        this DataModule's state in it) was made with another seed, batch size or number of ranks."""
        if "train_order" in saved_state:
            check_order_settings(saved_state["train_order"], self.order_settings() | {"num_replicas": num_replicas})

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training and self.train_sampler is not None:
            self.train_sampler.batches_done += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        if self.train_sampler is None or self.trainer is None:
            return {}
        order = self.train_sampler.state_dict()
        if order["batches_done"] >= self.trainer.num_training_batches:  # the epoch is over: resume at the next
            order |= {"epoch": order["epoch"] + 1, "batches_done": 0}
        return {"train_order": order}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_order = state_dict.get("train_order")
