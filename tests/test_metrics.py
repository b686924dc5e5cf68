"""lit_thresh.metrics: the per-step training metrics weigh by supervised tokens like the evaluation ones."""

import torch
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
