"""TorchMetrics for next-token prediction: loss, token accuracy and perplexity over supervised tokens."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

IGNORE_INDEX = -100  # labels that are not supervised


def gather_states(state: torch.Tensor, group: object | None = None) -> list[torch.Tensor]:
    """Every rank's copy of a metric state of the same shape on all ranks (a TokenMean's 0-d sums).

    torchmetrics' default gathers states of any shape behind a barrier, which waits for the GPU under
    NCCL; an all_gather alone queues on the GPU like any other kernel.
    """
    group = group or torch.distributed.group.WORLD
    gathered = [torch.empty_like(state) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, state.contiguous(), group=group)
    return gathered


class TokenMean(Metric):
    """Sum of values over a count of tokens, summed over updates (and over ranks when synced).

    Unlike torchmetrics' MeanMetric with ``nan_strategy="disable"`` it keeps the weights, and unlike its
    other strategies and MulticlassAccuracy(ignore_index=...), neither its update nor its DDP sync
    (gather_states) waits for the GPU.
    """

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("dist_sync_fn", gather_states)
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, total: torch.Tensor, count: torch.Tensor) -> None:
        """total: 0-d sum of the values; count: 0-d number of tokens they cover."""
        self.total += total.detach().double()
        self.count += count.double()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


def token_metrics(vocab_size: int, training: bool = False) -> nn.ModuleDict:
    """Loss (mean over supervised tokens) and token accuracy, plus perplexity unless training.

    training=True: TokenMean for both, free of host-device syncs, so the CPU can queue the next step while
    the GPU runs this one; the module computes them (synced over DDP ranks by gather_states) and resets
    them whenever the loggers write. Validation and test use torchmetrics' own MeanMetric,
    MulticlassAccuracy and Perplexity, synced at the end of the epoch.
    """
    if training:
        return nn.ModuleDict({name: TokenMean() for name in ("loss", "acc")})
    return nn.ModuleDict(
        {
            "loss": MeanMetric(),
            "acc": MulticlassAccuracy(vocab_size, average="micro", ignore_index=IGNORE_INDEX),
            "ppl": Perplexity(ignore_index=IGNORE_INDEX),
        }
    )


def update_token_metrics(
    metrics: nn.ModuleDict, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor
) -> None:
    """Feeds one batch to token_metrics: loss (0-d mean over supervised tokens), logits (B, T, V),
    labels (B, T) with IGNORE_INDEX where unsupervised. Updates only: no per-batch value is computed."""
    supervised = labels != IGNORE_INDEX  # (B, T)
    tokens = supervised.sum()
    if isinstance(metrics["loss"], TokenMean):
        correct = (logits.argmax(dim=-1) == labels) & supervised  # (B, T)
        metrics["loss"].update(loss * tokens, tokens)
        metrics["acc"].update(correct.sum(), tokens)
        return
    metrics["loss"].update(loss, tokens)  # weighted by the supervised tokens
    metrics["acc"].update(logits.argmax(dim=-1), labels)
    metrics["ppl"].update(logits.float(), labels)
