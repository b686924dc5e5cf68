"""Two-process DDP on CPU (gloo), launched as a user launches it: the logged metrics cover the whole
validation set, i.e. the ranks see different shards and their metrics are synced."""

import pytest
import torch
import torch.nn.functional as F

from lit_thresh.data import MQARDataModule, MQARSetting
from lit_thresh.module import LanguageModel
from tests.test_cli import QUICKSTART, run_cli, scalars

TRAIN = MQARSetting(seq_len=32, num_kv_pairs=4, num_examples=64)
VAL = MQARSetting(seq_len=32, num_kv_pairs=4, num_examples=40)  # 20 per rank: batches of 8, 8, 4


def test_ddp_fit_logs_metrics_of_the_whole_validation_set(tmp_path):
    run_cli(
        "fit",
        "--config",
        str(QUICKSTART),
        "--trainer.accelerator=cpu",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        f"--data.init_args.train=[{TRAIN._asdict()}]",
        f"--data.init_args.val=[{VAL._asdict()}]",
        "--data.init_args.batch_size=8",
        cwd=tmp_path,
    )
    run = tmp_path / "lightning_logs" / "quickstart" / "version_0"
    logged = scalars(run)

    # recompute the final validation on one process, from the checkpoint saved right after it
    model = LanguageModel.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    data = MQARDataModule(vocab_size=model.hparams.vocab_size, train=[TRAIN], val=[VAL])
    data.setup("validate")
    batch = data.datasets["val"][:]
    with torch.no_grad():
        logits = model(batch["input_ids"])  # (B, T, V)
    supervised = batch["labels"] != -100
    loss = F.cross_entropy(logits[supervised], batch["labels"][supervised])
    acc = (logits.argmax(-1)[supervised] == batch["labels"][supervised]).float().mean()
    assert logged["val/loss"][-1] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["val/acc"][-1] == pytest.approx(acc.item(), rel=1e-5)
