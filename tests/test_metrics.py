"""lit_thresh.metrics: the per-step training metrics weigh by supervised tokens like the evaluation ones."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lit_thresh.metrics import IGNORE_INDEX, TokenMean, token_metrics, update_token_metrics


def test_token_mean_weighs_by_count():
    metric = TokenMean()
    metric(torch.tensor(3.0), torch.tensor(3))  # 3 tokens of mean 1.0
    metric(torch.tensor(2.0), torch.tensor(1))  # 1 token of 2.0
    assert metric.compute().item() == 1.25


def test_training_metrics_equal_the_evaluation_metrics():
    gen = torch.Generator().manual_seed(0)
    train, evaluation = token_metrics(11, training=True), token_metrics(11)
    for batch, supervised in ((4, 0.3), (2, 0.9)):  # different numbers of supervised tokens per batch
        logits = torch.randn(batch, 7, 11, generator=gen)  # (B, T, V)
        labels = torch.randint(11, (batch, 7), generator=gen)  # (B, T)
        labels[torch.rand(batch, 7, generator=gen) > supervised] = IGNORE_INDEX
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        update_token_metrics(train, loss, logits, labels)
        update_token_metrics(evaluation, loss, logits, labels)
    for name in ("loss", "acc"):
        torch.testing.assert_close(train[name].compute(), evaluation[name].compute().float())
    assert "ppl" not in train and evaluation["ppl"].compute() > 1


def _sync_on_rank(rank: int, port: int, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dist.barrier = None  # torchmetrics' default gather calls it; TokenMean's must not
        metric = TokenMean()
        tokens = torch.tensor(3 + rank)  # unequal token counts: rank 0 has 3 tokens of 1.0, rank 1 has 4 of 2.0
        metric.update(tokens * (1.0 + rank), tokens)
        results[rank] = metric.compute().item()  # synced over both ranks
    finally:
        dist.destroy_process_group()


def test_token_mean_syncs_over_ranks_without_a_barrier():
    """Under DDP the computed value is the token-weighted mean over all ranks, gathered without
    torchmetrics' barrier (with NCCL a barrier waits for the GPU): 2 gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_sync_on_rank, args=(port, shared), nprocs=2)
        results = dict(shared)
    expected = (3 * 1.0 + 4 * 2.0) / 7
    assert sorted(results) == [0, 1]
    for value in results.values():
        assert abs(value - expected) < 1e-6
