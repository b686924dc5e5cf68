"""lit_thresh.callbacks in isolation (the CLI tests cover them inside runs)."""

from types import SimpleNamespace

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lit_thresh.callbacks import TokenThroughput


def test_token_throughput_waits_for_the_gpu_only_on_logged_training_steps(monkeypatch):
    """Lightning's ThroughputMonitor synchronises CUDA after every batch; TokenThroughput only on the steps
    whose rates are logged (and on every evaluation batch), and still counts every batch and token."""
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    counting = torch.cuda.synchronize
    logs = SimpleNamespace(should_update_logs=False)
    state = SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING)
    trainer = SimpleNamespace(state=state, strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), _logger_connector=logs)
    module = SimpleNamespace(flops_per_batch=None)
    callback = TokenThroughput()
    for stage in (RunningStage.TRAINING, RunningStage.VALIDATING):
        callback._throughputs[stage] = Throughput(world_size=1)
    callback._start(trainer)
    batch = {"input_ids": torch.randint(100, (4, 7))}  # (B, T)

    for step in range(1, 4):
        callback._update(trainer, module, batch, step)
    assert waits == []  # not logged: no wait
    logs.should_update_logs = True
    callback._update(trainer, module, batch, 4)
    assert len(waits) == 1
    logs.should_update_logs = False
    state.stage = RunningStage.VALIDATING
    callback._start(trainer)
    callback._update(trainer, module, batch, 1)
    assert len(waits) == 2  # evaluation batches: Lightning's behaviour
    assert callback._batches[RunningStage.TRAINING] == 4 and callback._lengths[RunningStage.TRAINING] == 4 * 4 * 7
    assert torch.cuda.synchronize is counting  # put back after each skipped wait
