"""lit_thresh.callbacks in isolation (the CLI tests cover them inside runs)."""

import signal
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_thresh.callbacks import MetricsTable, ProgressLog, SigtermCheck, TokenThroughput, TrainLossProgressBar
from lit_thresh.callbacks.monitoring import hparams_for_tensorboard
from lit_thresh.callbacks.run_config import run_started
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


@pytest.fixture
def two_rank_trainer(monkeypatch):
    """A Trainer that believes it has 2 ranks, over a 1-process gloo group (all-reduce works in-process)."""
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield L.Trainer(logger=False, accelerator="cpu")
    dist.destroy_process_group()


def test_sigterm_check_compares_flags_every_nth_batch_and_stops_once_signalled(two_rank_trainer):
    """The loop asks before every batch; the flags are compared on asks 0, 5, 10, ...; a SIGTERM only marks
    the rank, and the next comparison stops training (received_sigterm, SIGTERMException); teardown puts
    Lightning's methods back."""
    trainer = two_rank_trainer
    loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
    callback = SigtermCheck(5)
    callback.setup(trainer, None, "fit")
    for _ in range(12):  # asks 0..11
        loop._broadcast_sigterm_tensor()
    assert callback.checks == 3 and not trainer.received_sigterm
    connector._sigterm_notifier_fn(signal.SIGTERM, None)  # what Lightning registers as the SIGTERM handler
    assert not trainer.received_sigterm
    for _ in range(3):  # asks 12..14: no comparison
        loop._broadcast_sigterm_tensor()
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()  # ask 15
    assert callback.checks == 4 and trainer.received_sigterm
    callback.teardown(trainer, None, "fit")
    assert not {"_broadcast_sigterm_tensor", "_sigterm_notifier_fn"} & (vars(loop).keys() | vars(connector).keys())


@pytest.mark.parametrize("stage,every_n_batches,world_size", [("validate", 5, 2), ("fit", 1, 2), ("fit", 5, 1)])
def test_sigterm_check_leaves_lightning_alone(monkeypatch, stage, every_n_batches, world_size):
    """Outside fit, at every_n_batches 1, or in one process, Lightning keeps its own SIGTERM handling."""
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: world_size))
    trainer = L.Trainer(logger=False)
    SigtermCheck(every_n_batches).setup(trainer, None, stage)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
    assert "_sigterm_notifier_fn" not in vars(trainer._signal_connector)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "10"])
def test_sigterm_check_refuses_a_bad_interval(bad):
    with pytest.raises(ValueError, match=r"every_n_batches must be an int >= 1 \(1 = every batch\), got"):
        SigtermCheck(bad)


def test_hparams_for_tensorboard_are_readable_and_hold_the_seed():
    hparams = {
        "_instantiator": "lightning.pytorch.cli.instantiate_module",
        "config": {"d_model": 64, "attention": {"class_path": "a.Threshold", "init_args": {"beta": 1.0}}},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "foreach": None, "fused": None}},
        "lr_scheduler": {"class_path": "s.WarmupCosine", "init_args": {"warmup_steps": 100, "last_epoch": -1}},
        "batch_size": 16,
    }
    assert hparams_for_tensorboard(hparams, seed=1234) == {
        "d_model": 64,
        "attention/class_path": "a.Threshold",
        "attention/beta": 1.0,
        "optimizer/class_path": "torch.optim.AdamW",
        "optimizer/lr": 3e-3,
        "lr_scheduler/class_path": "s.WarmupCosine",
        "lr_scheduler/warmup_steps": 100,
        "batch_size": 16,
        "seed_everything": 1234,
    }


def test_metrics_table_has_a_row_per_metric_and_a_column_per_data_set(capsys):
    metrics = {"test/acc": 0.5, "test/loss": 1.25, "test/len64_n4/acc": 0.75, "test/len64_n4/loss": 2.5, "val/acc": 0.1}
    trainer = SimpleNamespace(callback_metrics={name: torch.tensor(value) for name, value in metrics.items()})
    MetricsTable.print_table(trainer, "test")
    lines = [line for line in capsys.readouterr().out.splitlines() if "│" in line or "┃" in line]
    cells = [[cell.strip() for cell in line.strip("│┃ ").replace("┃", "│").split("│")] for line in lines]
    assert cells == [["metric", "test", "len64_n4"], ["acc", "0.5", "0.75"], ["loss", "1.25", "2.5"]]


def test_progress_log_prints_step_loss_tokens_and_eta(tmp_path):
    """Every n-th optimizer step: a plain line (here with always=True: pytest's stdout is not a TTY anyway)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    progress = ProgressLog(every_n_steps=2, always=True)
    trainer = L.Trainer(
        max_steps=5, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[progress],
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert [line.split(" | ")[0] for line in progress.lines] == ["step 2/5", "step 4/5"]
    for line in progress.lines:
        step, epoch, loss, rate, eta = line.split(" | ")
        assert epoch == "epoch 0" and float(loss.removeprefix("loss ")) > 0
        assert rate.endswith(" tokens/s") and eta.startswith("ETA 0:")


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_progress_log_refuses_a_bad_interval(bad):
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        ProgressLog(bad)


def test_run_started_refuses_a_new_fit_over_a_run_and_lets_a_resume_keep_it(tmp_path):
    assert run_started(str(tmp_path), None) is False  # no run there yet
    (tmp_path / "config.yaml").write_text("seed_everything: 1\n")
    assert run_started(str(tmp_path), "last.ckpt") is True  # a resume: its config.yaml stays
    with pytest.raises(ValueError, match="already holds a run"):
        run_started(str(tmp_path), None)


@pytest.mark.parametrize("bad", [1, 0, 2.0, True])
def test_token_throughput_refuses_a_window_under_two(bad):
    with pytest.raises(ValueError, match=r"window_size must be an int >= 2"):
        TokenThroughput(window_size=bad)
