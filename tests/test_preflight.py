"""The check of ``val_check_interval`` before a fit (lit_thresh.preflight) sets the data up for the fit:
the fit does not set them up a second time."""

import lightning as L
import pytest
import torch

from lit_thresh import preflight
from lit_thresh.cli import main
from lit_thresh.data import MQARDataModule, MQARSetting
from tests.test_nan_guard import TINY

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


@pytest.fixture
def setups(monkeypatch) -> list[str]:
    """The stages MQARDataModule.setup runs for (and "prepare_data" for each prepare_data), in order."""
    calls: list[str] = []
    setup = MQARDataModule.setup
    monkeypatch.setattr(MQARDataModule, "prepare_data", lambda self: calls.append("prepare_data"))
    monkeypatch.setattr(MQARDataModule, "setup", lambda self, stage: calls.append(stage) or setup(self, stage))
    return calls


def test_a_fit_sets_its_data_up_once(tmp_path, monkeypatch, setups):
    """TINY: 8 training batches an epoch; with a val_check_interval in batches, the interval is checked on
    data set up before the fit, and the fit trains and validates on them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    args = ["fit", "--config", "tiny.yaml", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1"]
    main([*args, "--trainer.max_steps=6"])
    assert setups == ["prepare_data", "fit"]
    last = torch.load(tmp_path / "lightning_logs/nan/version_0/checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    assert len(list((tmp_path / "lightning_logs/nan/version_0/checkpoints").glob("epoch=0-step=*.ckpt"))) == 1


def test_only_the_fits_own_setup_is_skipped_in_this_process_only(monkeypatch, setups):
    data = MQARDataModule(
        vocab_size=32,
        train=[MQARSetting(seq_len=16, num_kv_pairs=2, num_examples=48)],
        val=[MQARSetting(seq_len=16, num_kv_pairs=2, num_examples=16)],
        test_length_multipliers=[],
        batch_size=8,
    )
    trainer = L.Trainer(accelerator="cpu", val_check_interval=6, logger=False, enable_progress_bar=False)
    preflight.check_val_check_interval(trainer, data)  # 6 batches an epoch: accepted
    assert setups == ["prepare_data", "fit"]
    data.prepare_data()
    data.setup(stage="fit")  # the fit's calls (Lightning passes the stage by name): skipped
    assert setups == ["prepare_data", "fit"]
    data.setup("fit")  # any later call runs
    assert setups == ["prepare_data", "fit", "fit"]

    too_long = L.Trainer(accelerator="cpu", val_check_interval=7, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"val_check_interval \(7 batches\) is longer than an epoch \(6 training"):
        preflight.check_val_check_interval(too_long, data)
    assert setups[3:] == ["prepare_data", "fit"]

    preflight.check_val_check_interval(trainer, data)
    monkeypatch.setattr(preflight.os, "getpid", lambda: -1)  # as a rank spawned with a copy of the DataModule
    data.setup(stage="fit")
    assert setups[5:] == ["prepare_data", "fit", "fit"]
