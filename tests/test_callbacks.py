"""lit_thresh.callbacks in isolation (the CLI tests cover them inside runs)."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lit_thresh.callbacks import SigtermBroadcast, TokenThroughput, TrainLossProgressBar
from tests.test_module import TinyData, model


def test_token_throughput_waits_for_the_gpu_only_on_logged_training_steps(monkeypatch):
    """Lightning's ThroughputMonitor synchronises CUDA after every batch; TokenThroughput only on the steps
    whose rates are logged (and on every evaluation batch), and still counts every batch and token."""
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    logs = SimpleNamespace(should_update_logs=False)
    state = SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING)
    cuda = SimpleNamespace(root_device=torch.device("cuda", 0))
    trainer = SimpleNamespace(state=state, strategy=cuda, _logger_connector=logs)
    module = SimpleNamespace(flops_per_batch=None)
    callback = TokenThroughput(window_size=3)
    for stage in (RunningStage.TRAINING, RunningStage.VALIDATING):
        callback._throughputs[stage] = Throughput(world_size=1, window_size=3)
    callback._start(trainer)
    batch = {"input_ids": torch.randint(100, (4, 7))}  # (B, T)

    for step in range(1, 4):
        callback._update(trainer, module, batch, step)
    assert waits == []  # not logged: no wait
    logs.should_update_logs = True
    callback._update(trainer, module, batch, 4)
    assert len(waits) == 1
    rates = callback._throughputs[RunningStage.TRAINING].compute()
    assert rates["device/batches_per_sec"] > 0 and rates["device/items_per_sec"] == pytest.approx(4 * 7 * rates["device/batches_per_sec"])
    logs.should_update_logs = False
    state.stage = RunningStage.VALIDATING
    callback._start(trainer)
    callback._update(trainer, module, batch, 1)
    assert len(waits) == 2  # evaluation batches: Lightning's behaviour
    assert callback._batches[RunningStage.TRAINING] == 4 and callback._lengths[RunningStage.TRAINING] == 4 * 4 * 7


def test_progress_bar_shows_the_logged_training_loss(tmp_path):
    """train/loss is not a prog_bar value (read back every step); the bar shows the loss of the steps
    written to the loggers instead, and nothing before the first of them."""
    bar = TrainLossProgressBar()
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, bar.get_metrics(trainer, pl_module).get("train/loss")))

    trainer = L.Trainer(
        max_steps=4, log_every_n_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[bar, Record()],
    )
    trainer.fit(model(), train_dataloaders=TinyData().train_dataloader())
    assert [step for step, _ in seen] == [1, 2, 3, 4]
    assert seen[0][1] is None and seen[1][1] is not None and seen[2][1] == seen[1][1] and seen[3][1] != seen[1][1]
    assert all(isinstance(loss, float) and loss > 0 for _, loss in seen[1:])


@pytest.mark.parametrize("every_n_batches,broadcasts", [(1, list(range(12))), (5, [0, 5, 10]), (20, [0])])
def test_sigterm_broadcast_runs_lightnings_broadcast_on_every_nth_batch(monkeypatch, every_n_batches, broadcasts):
    """The training loop asks for the SIGTERM broadcast before every batch; Lightning's own broadcast runs
    on the first of every n of those asks, on this trainer's loop only, and is put back at teardown."""
    ran = []
    monkeypatch.setattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", lambda loop: ran.append((loop, asks)))
    trainer, other = L.Trainer(logger=False), L.Trainer(logger=False)
    loop = trainer.fit_loop.epoch_loop
    callback = SigtermBroadcast(every_n_batches)
    callback.setup(trainer, None, "fit")
    for asks in range(12):
        loop._broadcast_sigterm_tensor()
    assert ran == [(loop, i) for i in broadcasts]
    other.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # another trainer's loop: untouched
    assert ran[-1][0] is other.fit_loop.epoch_loop
    callback.teardown(trainer, None, "fit")
    ran.clear()
    for asks in range(3):
        loop._broadcast_sigterm_tensor()
    assert ran == [(loop, 0), (loop, 1), (loop, 2)]  # Lightning's again, every batch


def test_sigterm_broadcast_leaves_other_stages_alone(monkeypatch):
    trainer = L.Trainer(logger=False)
    SigtermBroadcast(4).setup(trainer, None, "validate")
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "10"])
def test_sigterm_broadcast_refuses_a_bad_interval(bad):
    with pytest.raises(ValueError, match=r"every_n_batches must be an int >= 1 \(1 = every batch\), got"):
        SigtermBroadcast(bad)
