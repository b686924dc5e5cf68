"""Datasets that hand the DataLoader a whole batch at once: one gather per tensor instead of a Python
call and a stack per sample, so the training loop's CPU spends microseconds, not milliseconds, a batch."""

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset


class TensorRows(Dataset[dict[str, Tensor]]):
    """Rows of tensors of equal length N, by name: item i is ``{name: tensor[i]}``; the DataLoader's
    batch of indices is ``{name: tensor[indices]}`` (``__getitems__``) when its collate_fn is
    ``collate_batch``."""

    def __init__(self, **tensors: Tensor) -> None:
        lengths = {name: len(tensor) for name, tensor in tensors.items()}
        if not tensors or len(set(lengths.values())) != 1:
            raise ValueError(f"TensorRows needs tensors of one length, got lengths {lengths}")
        self.tensors = tensors  # name -> (N, ...)

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int | slice) -> dict[str, Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, Tensor]:
        index = torch.as_tensor(indices)  # (B,)
        return {name: tensor[index] for name, tensor in self.tensors.items()}  # name -> (B, ...)


def collate_batch(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The DataLoader's collate_fn for datasets whose ``__getitems__`` returns the collated batch."""
    return batch


def batched_loader_options(num_workers: int) -> dict[str, Any]:
    """DataLoader options for such datasets: ``collate_batch``, and batches pinned on CUDA so that their
    copy to the GPU does not wait for the GPU's queued work."""
    return {"num_workers": num_workers, "pin_memory": torch.cuda.is_available(), "collate_fn": collate_batch}
