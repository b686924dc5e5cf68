"""SteadyHost: Python's garbage collector off during training, full collections at fixed steps, timed."""

import csv
import gc

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lit_thresh.callbacks.steady import SteadyHost
from tests.test_module import TinyData, model, trainer

STEPS = 6  # TinyData: 2 training batches an epoch, so 3 epochs


class GCState(L.Callback):
    """Test probe: whether automatic collection is on and how many objects are frozen, at every step's end
    (after SteadyHost's own hook), and a collection it forces at step `collect_at` (0: none)."""

    def __init__(self, collect_at: int = 0) -> None:
        self.collect_at = collect_at
        self.enabled: list[bool] = []
        self.frozen: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.enabled.append(gc.isenabled())
        self.frozen.append(gc.get_freeze_count())
        if trainer.global_step == self.collect_at:
            gc.collect()


def fit(tmp_path, steady: SteadyHost, probe: GCState, **kwargs) -> list[dict[str, str]]:
    """Fits the tiny model for STEPS steps with `steady` then `probe`; the rows of metrics.csv with perf/gc_ms."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    options = dict(max_steps=STEPS, limit_val_batches=0, log_every_n_steps=2, logger=logger) | kwargs
    trainer(tmp_path, callbacks=[steady, probe], **options).fit(model(), datamodule=TinyData())
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        return [row for row in csv.DictReader(file) if row.get("perf/gc_ms")]


@pytest.fixture
def gc_restored():
    """Puts Python's collector back as it was, whatever a test did to it."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def test_collections_run_at_fixed_steps_with_automatic_collection_off(tmp_path, gc_restored):
    gc.enable()
    steady, probe = SteadyHost(every_n_steps=2), GCState()
    rows = fit(tmp_path, steady, probe)
    assert probe.enabled == [False] * STEPS
    assert steady.collections == 1 + STEPS // 2  # at the start, then after steps 2, 4, 6
    assert all(count > 0 for count in probe.frozen)  # the survivors of each collection are frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as before the fit
    assert [int(row["step"]) for row in rows] == [1, 3, 5]  # logged on the loggers' steps (0-based)
    assert float(rows[0]["perf/gc_ms"]) > 0  # the first window holds the collection at the start


def test_a_step_of_several_batches_collects_once(tmp_path, gc_restored):
    steady = SteadyHost(every_n_steps=1)
    fit(tmp_path, steady, GCState(), accumulate_grad_batches=2)  # 2 batches a step, over 6 epochs
    assert steady.collections == 1 + STEPS


def test_automatic_collection_stays_off_after_a_fit_if_it_was_off(tmp_path, gc_restored):
    gc.disable()
    fit(tmp_path, SteadyHost(every_n_steps=2), GCState())
    assert not gc.isenabled() and gc.get_freeze_count() == 0


class FailAt(L.Callback):
    """Test probe: raises at the end of training step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("probe")


def test_a_failed_fit_puts_automatic_collection_back(tmp_path, gc_restored):
    """Lightning calls on_exception, not teardown, when a fit fails."""
    gc.enable()
    with pytest.raises(RuntimeError, match="probe"):
        fit(tmp_path, SteadyHost(every_n_steps=2), FailAt(3))
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_every_n_steps_0_times_automatic_collection_and_changes_nothing(tmp_path, gc_restored):
    gc.enable()
    steady, probe = SteadyHost(every_n_steps=0), GCState(collect_at=3)
    rows = fit(tmp_path, steady, probe)
    assert probe.enabled == [True] * STEPS and probe.frozen == [0] * STEPS
    assert steady.collections == 0
    gc_ms = {int(row["step"]): float(row["perf/gc_ms"]) for row in rows}
    assert gc_ms[3] > 0  # the window of steps 3-4 (0-based 2-3) holds the probe's full collection


@pytest.mark.parametrize("bad", [-1, 2.0, True, "100", None])
def test_steady_host_refuses_a_bad_interval(bad):
    with pytest.raises(ValueError, match=r"every_n_steps must be an int >= 0 \(0: automatic collection, timed\), got"):
        SteadyHost(bad)
