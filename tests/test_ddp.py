"""Two-process DDP on CPU (gloo), launched as a user launches it, against one process with the same global
batch: the same training batches split over the ranks, the same loss curve, and synced validation metrics
that cover the whole validation set."""

import json
import os
import signal
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_thresh.callbacks import SigtermCheck
from lit_thresh.data import MQARDataModule, MQARSetting
from lit_thresh.module import LanguageModel
from tests.test_cli import ENV, QUICKSTART, command_line

pytestmark = pytest.mark.slow  # every test runs the lit_thresh command (2 gloo processes) in subprocesses
TRAIN = MQARSetting(seq_len=32, num_kv_pairs=4, num_examples=96)  # 6 steps an epoch: 8 a rank, or 16
VAL = MQARSetting(seq_len=32, num_kv_pairs=4, num_examples=40)  # 20 per rank: batches of 8, 8, 4
BATCH = 8  # per rank; the one-process run takes 2 * BATCH
EPOCHS = 2
STEPS = EPOCHS * TRAIN.num_examples // (2 * BATCH)
RUN = Path("lightning_logs/quickstart/version_0")
# 2 ranks vs 1 process: the same gradients up to float32 summation order (the all-reduce adds two
# half-batch gradients). With softmax attention the 12 losses differed by at most 1.2e-7 relative and
# the validation metrics not at all. Threshold attention amplifies rounding (its per-head output RMSNorm
# rescales rows that barely pass the threshold): its curves part by ~1e-2 after 10 steps at lr 1e-2 even
# in one process that sums the batch as two halves, so the test trains softmax attention.
LOSS_RTOL = 1e-5
SIGTERM_EVERY = 5  # the ranks compare SIGTERM flags before training batches 0, 5, 10 (of both epochs' 12)
SIGTERM_AT = 7  # a step between two of those: every rank stops after step 10


class RecordBatches(Callback):
    """Test probe: writes each rank's training batches (token rows), its own loss of each step, its
    validation rows and whether SigtermCheck compared the ranks' SIGTERM flags before each training
    batch to `batches_rank<r>.json` in the working directory."""

    def __init__(self) -> None:
        self.record: dict[str, list] = {"train": [], "loss": [], "val": [], "sigterm": []}
        self.seen = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        (sigterm,) = [callback for callback in trainer.callbacks if isinstance(callback, SigtermCheck)]
        self.record["sigterm"].append(sigterm.checks > self.seen)
        self.seen = sigterm.checks

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.record["train"].append(batch["input_ids"].tolist())  # (B, T)
        self.record["loss"].append(outputs["loss"].item())

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        if not trainer.sanity_checking and trainer.current_epoch == 0:
            self.record["val"].extend(batch["input_ids"].tolist())

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        Path(f"batches_rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


class SigtermOneRank(Callback):
    """Test probe: rank `rank` sends itself SIGTERM after training step SIGTERM_AT (as a scheduler's
    preemption would); each rank writes the steps it finished to `steps_rank<r>.json`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.steps.append(trainer.global_step)
        Path(f"steps_rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))
        if trainer.global_rank == self.rank and trainer.global_step == SIGTERM_AT:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(cwd: Path, *devices: str, batch_size: int, returncode: int = 0) -> str:
    """The quickstart at the sizes above, with this file's RecordBatches, on CPU, run as test_cli.run_cli
    runs it; fails unless the command exits with `returncode`. Returns what it printed to stderr."""
    args = command_line(
        "fit",
        "--config",
        str(QUICKSTART),
        "--trainer.accelerator=cpu",
        *devices,
        f"--trainer.max_epochs={EPOCHS}",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=tests.test_ddp.RecordBatches",
        f"--sigterm.every_n_batches={SIGTERM_EVERY}",
        "--model.config.attention=SoftmaxAttention",  # see LOSS_RTOL
        "--model.optimizer.init_args.lr=1e-2",  # no warmup, a larger step: the model learns in 12 steps
        "--model.lr_scheduler.init_args.warmup_steps=0",
        f"--data.init_args.train=[{TRAIN._asdict()}]",
        f"--data.init_args.val=[{VAL._asdict()}]",
        f"--data.init_args.batch_size={batch_size}",
    )
    result = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == returncode, result.stderr[-3000:]
    return result.stderr


def import_probes(patch: pytest.MonkeyPatch) -> None:
    """Lets the command's processes import this file's probes (tests.test_ddp): the repository root on
    the PYTHONPATH of the command's environment (test_cli.ENV, os.environ as tests.test_cli loaded)."""
    root = Path(__file__).parents[1]
    patch.setitem(ENV, "PYTHONPATH", os.pathsep.join(filter(None, [str(root), ENV.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The working directories of a 2-process DDP fit (BATCH per rank) and a 1-process fit (2 * BATCH)."""
    with pytest.MonkeyPatch.context() as patch:
        import_probes(patch)
        ddp, single = tmp_path_factory.mktemp("ddp"), tmp_path_factory.mktemp("single")
        fit(ddp, "--trainer.strategy=ddp", "--trainer.devices=2", batch_size=BATCH)
        fit(single, "--trainer.devices=1", batch_size=2 * BATCH)
    return {"ddp": ddp, "single": single}


def records(cwd: Path) -> list[dict[str, list]]:
    """RecordBatches' records, by rank."""
    return [json.loads(path.read_text()) for path in sorted(cwd.glob("batches_rank*.json"))]


def curve(run: Path, tag: str) -> torch.Tensor:
    """The values logged to TensorBoard under tag during training (HparamsWithMetrics logs the final
    ones once more, at step STEPS)."""
    events = EventAccumulator(str(run))
    events.Reload()
    return torch.tensor([event.value for event in events.Scalars(tag) if event.step < STEPS])


def rows(batch: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(row) for row in batch}


def test_each_rank_sees_its_own_half_of_the_one_process_batches(runs):
    rank0, rank1 = records(runs["ddp"])
    (single,) = records(runs["single"])
    assert len(rank0["train"]) == len(rank1["train"]) == len(single["train"]) == STEPS
    for epoch in range(EPOCHS):
        epoch_steps = slice(epoch * STEPS // EPOCHS, (epoch + 1) * STEPS // EPOCHS)
        seen = [set().union(*map(rows, rank["train"][epoch_steps])) for rank in (rank0, rank1)]
        assert len(seen[0]) == len(seen[1]) == TRAIN.num_examples // 2 and not seen[0] & seen[1]
    for b0, b1, b in zip(rank0["train"], rank1["train"], single["train"], strict=True):
        assert len(b0) == len(b1) == BATCH and len(b) == 2 * BATCH
        assert sorted(b0 + b1) == sorted(b)  # the global batch is the one-process batch
    assert single["train"][: STEPS // EPOCHS] != single["train"][STEPS // EPOCHS :]  # reshuffled each epoch

    val0, val1 = rows(rank0["val"]), rows(rank1["val"])
    assert len(val0) == len(val1) == VAL.num_examples // 2 and not val0 & val1
    assert val0 | val1 == rows(single["val"])


def test_the_ranks_compare_sigterm_flags_every_n_batches(runs):
    """SigtermCheck compares the ranks' flags before the same batches on both ranks, every
    SIGTERM_EVERY-th counted over the epochs, and never in one process (Lightning's own handling there)."""
    (single,) = records(runs["single"])
    expected = [step % SIGTERM_EVERY == 0 for step in range(STEPS)]
    assert [rank["sigterm"] for rank in records(runs["ddp"])] == [expected, expected]
    assert single["sigterm"] == [False] * STEPS


def test_the_loss_curve_is_the_one_process_curve(runs):
    rank0, rank1 = records(runs["ddp"])
    # every sequence holds num_kv_pairs supervised tokens, so the global batch's loss is the mean of the ranks'
    ranks_mean = torch.tensor([(a + b) / 2 for a, b in zip(rank0["loss"], rank1["loss"], strict=True)])
    single = curve(runs["single"] / RUN, "train/loss")  # what the one-process run logged
    assert len(single) == len(ranks_mean) == STEPS
    assert single[-1] < single[0]  # it trains
    torch.testing.assert_close(ranks_mean, single, rtol=LOSS_RTOL, atol=0)
    assert not torch.equal(torch.tensor(rank0["loss"]), torch.tensor(rank1["loss"]))  # the ranks' halves differ


@pytest.mark.parametrize("metric", ["train/loss", "train/acc"])
def test_logged_training_metrics_are_synced_every_step(runs, metric):
    """What TensorBoard shows for the DDP run is the global batch's value, not rank 0's half."""
    ddp, single = curve(runs["ddp"] / RUN, metric), curve(runs["single"] / RUN, metric)
    assert len(ddp) == len(single) == STEPS
    torch.testing.assert_close(ddp, single, rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("metric", ["val/loss", "val/acc", "val/ppl"])
def test_logged_validation_metrics_are_the_one_process_values(runs, metric):
    ddp, single = curve(runs["ddp"] / RUN, metric), curve(runs["single"] / RUN, metric)
    assert len(ddp) == len(single) == EPOCHS
    torch.testing.assert_close(ddp, single, rtol=LOSS_RTOL, atol=0)


def test_logged_validation_metrics_cover_the_whole_validation_set(runs):
    run = runs["ddp"] / RUN
    # recompute a validation on one process, from the checkpoint saved right after it (Lightning updates
    # last.ckpt only with a new best one)
    ckpt = run / "checkpoints" / "last.ckpt"
    epoch = torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"]
    model = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu").eval()
    data = MQARDataModule(vocab_size=model.model.config.vocab_size, train=[TRAIN], val=[VAL])
    data.setup("validate")
    batch = data.datasets["val"][:]
    with torch.no_grad():
        logits = model(batch["input_ids"])  # (B, T, V)
    supervised = batch["labels"] != -100
    loss = F.cross_entropy(logits[supervised], batch["labels"][supervised])
    acc = (logits.argmax(-1)[supervised] == batch["labels"][supervised]).float().mean()
    assert curve(run, "val/loss")[epoch].item() == pytest.approx(loss.item(), rel=1e-5)
    assert curve(run, "val/acc")[epoch].item() == pytest.approx(acc.item(), rel=1e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path, monkeypatch, rank):
    """A SIGTERM to one rank after step SIGTERM_AT: both ranks train on to the next comparison of their
    flags (before step 11) and stop there, together, and the command ends with status 143 (128 + SIGTERM).
    Rank 0 also passes the signal on to rank 1 (Lightning's launcher started it); a signal to rank 1 alone
    reaches rank 0 only through the comparison."""
    import_probes(monkeypatch)
    probe = f"--trainer.callbacks+={{class_path: tests.test_ddp.SigtermOneRank, init_args: {{rank: {rank}}}}}"
    stderr = fit(tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2", probe, batch_size=BATCH, returncode=143)
    stop = -(-SIGTERM_AT // SIGTERM_EVERY) * SIGTERM_EVERY  # the first comparison after the signal
    assert f"fit stopped by SIGTERM at step {stop}" in stderr
    ranks = [json.loads((tmp_path / f"steps_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [list(range(1, stop + 1))] * 2
