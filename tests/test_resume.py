"""Crash and resume, as a user runs it: ``lit_thresh fit --config tiny.yaml --ckpt_path last`` killed with
SIGKILL mid-training and run again ends where an uninterrupted run ends, in the same run directory, on
the same batches; a save killed halfway leaves the previous checkpoint."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import StackDataset

from lit_thresh.checkpoint_io import AtomicCheckpointIO, temporary_files
from lit_thresh.cli import build_cli, main
from lit_thresh.data.resumable import ResumableSampler
from lit_thresh.resume import LOCK_NAME, RunLock, run_folders
from tests.test_nan_guard import TINY as NAN_TINY

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

ROOT = Path(__file__).parents[1]
PAUSE_ENV = "LIT_THRESH_TEST_PAUSE_AT_STEP"
STEPS_PER_EPOCH, EPOCHS = 8, 3
SAVED_AT, KILL_AT = 12, 14  # killed in epoch 1 before step 14; the last checkpoint is step 12's
# A tiny MQAR run (3 epochs of 8 steps, dropout on) that writes last.ckpt every 4 steps and records
# each training batch.
TINY = f"""
seed_everything: 1234
trainer:
  accelerator: cpu
  max_epochs: {EPOCHS}
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  gradient_clip_val: 1.0
  logger:
    init_args: {{name: tiny}}
  callbacks:
    - class_path: tests.test_resume.RecordBatches
      init_args: {{path: batches.txt}}
checkpoint: {{monitor: val/acc, mode: max}}
step_checkpoint: {{every_n_train_steps: 4}}
diagnostics: {{enabled: false}}
model:
  config:
    d_model: 32
    n_layers: 2
    mlp_ratio: 2
    dropout: 0.1
    key_conv: 2
    attention: {{class_path: lit_thresh.attention.ThresholdAttention}}
  optimizer: {{class_path: torch.optim.AdamW, init_args: {{lr: 3.0e-3}}}}
  lr_scheduler: {{class_path: lit_thresh.schedule.WarmupCosine, init_args: {{warmup_steps: 4}}}}
data:
  class_path: lit_thresh.data.MQARDataModule
  init_args:
    vocab_size: 64
    train: [{{seq_len: 32, num_kv_pairs: 4, num_examples: {16 * STEPS_PER_EPOCH}}}]
    val: [{{seq_len: 32, num_kv_pairs: 4, num_examples: 32}}]
    test_length_multipliers: []
    batch_size: 16
"""


class RecordBatches(Callback):
    """Appends ``<global step> <digest of the batch>`` to ``path`` before every training step; with
    PAUSE_ENV set to K, waits before step K until it is killed."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: dict, batch_idx: int) -> None:
        digest = hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]
        with self.path.open("a") as f:
            f.write(f"{trainer.global_step} {digest}\n")
        if trainer.global_step == int(os.environ.get(PAUSE_ENV, -1)):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the test kills us here
                time.sleep(0.05)


def command(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "lit_thresh"), *args]


def environment(**extra: str) -> dict[str, str]:
    """The test's environment for the command: PyTorch kernels (no Triton interpreter), offline, one thread
    per process (two runs share the CPU), and this repository importable (for RecordBatches)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", PAUSE_ENV)}
    return env | {"HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def fit(cwd: Path, **env: str) -> subprocess.Popen:
    """``lit_thresh fit --config tiny.yaml --ckpt_path last`` in cwd: the same command starts and resumes."""
    args = command("fit", "--config", "tiny.yaml", "--ckpt_path", "last")
    return subprocess.Popen(args, cwd=cwd, env=environment(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen, timeout: float = 240) -> str:
    """Waits for a run that must succeed; returns its stderr."""
    _, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err.decode()[-3000:]
    return err.decode()


def checkpoint_step(path: Path) -> int | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    except (FileNotFoundError, RuntimeError, EOFError):  # not written yet
        return None


def paused_at(record: Path, step: int) -> bool:
    """Whether RecordBatches wrote step's line last (it pauses after writing it)."""
    lines = record.read_text().splitlines() if record.exists() else []
    return bool(lines) and lines[-1].startswith(f"{step} ")


def batches(path: Path) -> list[tuple[int, str]]:
    return [(int(step), digest) for step, digest in (line.split() for line in path.read_text().splitlines())]


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a TensorBoard scalar over every event file of run_dir; EventAccumulator drops
    the points a restarted writer logs again."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """An uninterrupted run ("straight") and, beside it, one killed with SIGKILL before step KILL_AT (two
    steps after its last checkpoint, logged but lost) and resumed with the same command ("resumed"), both
    of TINY; returns their working directories and the resumed run's stderr."""
    root = tmp_path_factory.mktemp("resume")
    cwds = {name: root / name for name in ("straight", "resumed")}
    for cwd in cwds.values():
        cwd.mkdir()
        (cwd / "tiny.yaml").write_text(TINY)
    straight = fit(cwds["straight"])
    killed = fit(cwds["resumed"], **{PAUSE_ENV: str(KILL_AT)})
    last = cwds["resumed"] / "lightning_logs/tiny/version_0/checkpoints/last.ckpt"
    record = cwds["resumed"] / "batches.txt"
    deadline = time.monotonic() + 240
    # poll the checkpoints folder (and the record, for the pause at KILL_AT)
    while checkpoint_step(last) != SAVED_AT or not paused_at(record, KILL_AT):
        assert killed.poll() is None, killed.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the step to kill at"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    # a save killed halfway leaves a temporary file beside last.ckpt: it must not get in the way
    (last.parent / f".last.ckpt.{'0' * 32}.tmp").write_bytes(b"half a checkpoint")
    resume_stderr = finish(fit(cwds["resumed"]))
    finish(straight)
    return cwds | {"resume_stderr": resume_stderr}


def test_resume_continues_the_same_run_directory(runs):
    assert [p.name for p in (runs["resumed"] / "lightning_logs/tiny").iterdir()] == ["version_0"]
    checkpoints = runs["resumed"] / "lightning_logs/tiny/version_0/checkpoints"
    restoring = "Restoring states from the checkpoint path at lightning_logs/tiny/version_0/checkpoints/last.ckpt"
    assert restoring in runs["resume_stderr"]
    assert not temporary_files(checkpoints / "last.ckpt")  # the next save removed the leftover
    assert not list(checkpoints.glob("last-v*.ckpt"))
    assert checkpoint_step(checkpoints / "last.ckpt") == EPOCHS * STEPS_PER_EPOCH
    best = [p for p in checkpoints.glob("*.ckpt") if p.name != "last.ckpt"]
    assert len(best) == 1  # save_top_k=1, also across the resume
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    saved_best = {state["best_model_path"] for key, state in last["callbacks"].items() if "val/acc" in key}
    assert saved_best == {str(best[0].relative_to(runs["resumed"]))}  # the file that exists
    assert "not resumable" not in runs["resume_stderr"]  # the training loader's state is Lightning's to restore
    assert "could not find the monitored key" not in runs["resume_stderr"]
    assert "exists and is not empty" not in runs["resume_stderr"]  # the folder it resumes from, as expected


def test_resume_sees_the_uninterrupted_batches(runs):
    straight = batches(runs["straight"] / "batches.txt")
    assert [step for step, _ in straight] == list(range(EPOCHS * STEPS_PER_EPOCH))
    assert len({digest for _, digest in straight}) == len(straight)  # a fresh batch each step
    resumed = batches(runs["resumed"] / "batches.txt")  # the killed run's steps 0..KILL_AT, then the resumed run's
    steps = EPOCHS * STEPS_PER_EPOCH
    assert [step for step, _ in resumed] == list(range(KILL_AT + 1)) + list(range(SAVED_AT, steps))
    assert resumed[: KILL_AT + 1] == straight[: KILL_AT + 1]
    assert resumed[KILL_AT + 1 :] == straight[SAVED_AT:]  # mid-epoch: the rest of epoch 1, then epoch 2


def test_resume_ends_with_the_uninterrupted_losses(runs):
    straight, resumed = (runs[name] / "lightning_logs/tiny/version_0" for name in ("straight", "resumed"))
    for tag, count in [("train/loss", EPOCHS * STEPS_PER_EPOCH), ("val/loss", EPOCHS)]:
        expected, found = scalars(straight, tag), scalars(resumed, tag)
        assert len(expected) >= count and [s for s, _ in found] == [s for s, _ in expected]
        # dropout is on: equal losses after the resume need the restored RNG state
        assert [v for _, v in found] == pytest.approx([v for _, v in expected], abs=1e-5), tag
    weights = [
        torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        for run in (straight, resumed)
    ]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=1e-6)


def copy_run(cwd: Path, to: Path) -> Path:
    """A copy of a run's working directory (a refused resume must not touch the fixture's)."""
    return Path(shutil.copytree(cwd, to))


def test_resume_refuses_other_model_arguments(runs, monkeypatch, tmp_path):
    monkeypatch.chdir(copy_run(runs["resumed"], tmp_path / "run"))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--model.config.dropout=0.2", "--model.optimizer.lr=0.01"])
    message = str(exit_info.value.code)
    assert "model.config.dropout: checkpoint 0.1, given 0.2" in message
    assert "model.optimizer.init_args.lr: checkpoint 0.003, given 0.01" in message
    assert "lightning_logs/tiny/version_0/checkpoints/last.ckpt" in message


def test_resume_refuses_other_data_order(runs, monkeypatch, tmp_path):
    run = copy_run(runs["straight"], tmp_path / "run")
    monkeypatch.chdir(run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--data.init_args.batch_size", "8"])
    assert "batch_size 16 -> 8" in str(exit_info.value.code)
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after == before  # refused before anything is written: config.yaml and events untouched


def test_resume_refuses_a_run_another_process_writes(runs, monkeypatch, tmp_path):
    run = copy_run(runs["resumed"], tmp_path / "run")
    monkeypatch.chdir(run)
    holder = RunLock(run / "lightning_logs/tiny/version_0")  # as the fit still writing into it holds it
    holder.acquire()
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "tiny.yaml", "--ckpt_path", "last"])
    holder.release()
    assert "lightning_logs/tiny/version_0: another lit_thresh run is writing" in str(exit_info.value.code)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize(
    "args,locked",
    [
        ([], "lightning_logs/nan/version_0"),  # the checkpoints' run directory, logs included
        (["--checkpoint.dirpath=ckpts"], "ckpts"),
        (["--trainer.logger=false"], "checkpoints"),  # <default_root_dir>/checkpoints
        (["--trainer.enable_checkpointing=false"], "lightning_logs/nan/version_0"),  # the logs only
    ],
)
def test_a_fit_locks_the_folder_its_checkpoints_go_to(tmp_path, monkeypatch, args, locked):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    trainer = build_cli(["--config", "tiny.yaml", *args], run=False).trainer
    assert [folder.resolve() for folder in run_folders(trainer)] == [(tmp_path / locked).resolve()]


@pytest.mark.parametrize("args", [["--checkpoint.dirpath=ckpts"], ["--trainer.logger=false"]])
def test_a_resume_into_a_locked_checkpoint_folder_is_refused(tmp_path, monkeypatch, args):
    """A checkpoint folder outside a logger's run directory (a given dirpath, or no logger) is locked: a
    second process resuming from it is refused before it writes anything, wherever its logs would go."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    args = ["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--step_checkpoint.every_n_train_steps=2", *args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*args, "--trainer.max_steps=2"])
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # its lock is no other run's
    (lock,) = tmp_path.rglob(LOCK_NAME)
    folder = lock.parent
    assert folder.name == ("ckpts" if "ckpts" in args[-1] else "checkpoints") and (folder / "last.ckpt").is_file()

    holder = RunLock(folder)  # as the first fit, still writing into it, holds it
    holder.acquire()
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--trainer.max_steps=4"])
    finally:
        holder.release()
    assert f"{folder.resolve()}: another lit_thresh run is writing into this folder" in str(exit_info.value.code)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before


def test_a_resume_stopped_mid_epoch_warns_of_nothing(tmp_path, monkeypatch):
    """A run stopped by max_steps mid-epoch, resumed mid-epoch and stopped again before its next validation:
    no warning that the loader is not resumable, that the checkpoint folder is not empty, or that the
    monitored metric is missing; the first run's lock was released, so the second may take it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    args = ["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--step_checkpoint.every_n_train_steps=3"]
    args += ["--trainer.max_epochs=2"]
    main([*args, "--trainer.max_steps=6"])  # 8 steps an epoch: stops in epoch 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*args, "--trainer.max_steps=12"])  # resumes at step 6, validates at 8, stops at 12
    said = [str(w.message) for w in caught]
    for noise in ("not resumable", "exists and is not empty", "could not find the monitored key"):
        assert not [message for message in said if noise in message], said
    checkpoints = tmp_path / "lightning_logs/nan/version_0/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert checkpoint_step(checkpoints / "last.ckpt") == 12


def test_last_is_looked_up_under_default_root_dir(tmp_path, monkeypatch):
    """With --trainer.default_root_dir, logs and checkpoints go under it, and `--ckpt_path last` resumes the
    run there (not a run in ./lightning_logs)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    args = ["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--trainer.default_root_dir=elsewhere"]
    args += ["--step_checkpoint.every_n_train_steps=3", "--trainer.max_epochs=2"]
    main([*args, "--trainer.max_steps=6"])
    main([*args, "--trainer.max_steps=9"])  # resumes at step 6
    run = tmp_path / "elsewhere/lightning_logs/nan"
    assert sorted(p.name for p in run.iterdir()) == ["version_0"]  # the same run, no second version
    assert checkpoint_step(run / "version_0/checkpoints/last.ckpt") == 9
    assert not (tmp_path / "lightning_logs").exists()


def test_last_with_a_given_version_resumes_that_run(tmp_path, monkeypatch):
    """`--ckpt_path last` with the logger's version given resumes that run, not the newest one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    args = ["fit", "--config", "tiny.yaml", "--ckpt_path", "last", "--step_checkpoint.every_n_train_steps=3"]
    args += ["--trainer.max_epochs=2"]
    main([*args, "--trainer.logger.init_args.version=0", "--trainer.max_steps=3"])
    main([*args, "--trainer.logger.init_args.version=1", "--trainer.max_steps=6"])  # the newest run, at step 6
    main([*args, "--trainer.logger.init_args.version=0", "--trainer.max_steps=5"])  # resumes version 0 at step 3
    runs = tmp_path / "lightning_logs/nan"
    assert checkpoint_step(runs / "version_0/checkpoints/last.ckpt") == 5  # from version 1's step 6 it would not train
    assert checkpoint_step(runs / "version_1/checkpoints/last.ckpt") == 6


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_sampler_resumes_mid_epoch(num_replicas):
    dataset = StackDataset(torch.randint(100, (50, 3)))
    seed, epoch, batch_size, done = int(torch.randint(1000, ())), 3, 4, 5
    for rank in range(num_replicas):
        sampler = ResumableSampler(dataset, batch_size, seed=seed, num_replicas=num_replicas, rank=rank)
        sampler.set_epoch(epoch)
        whole = list(sampler)
        sampler.batches_done = done
        state = sampler.state_dict()

        fresh = ResumableSampler(dataset, batch_size, seed=seed, num_replicas=num_replicas, rank=rank)
        fresh.load_state_dict(state)
        assert list(fresh) == whole[done * batch_size :] and len(fresh) == len(whole)
        fresh.set_epoch(epoch)  # Lightning's call for the resumed epoch keeps the position
        assert list(fresh) == whole[done * batch_size :]
        fresh.set_epoch(epoch + 1)  # the next epoch starts at its beginning, in another order
        assert len(list(fresh)) == len(whole) and list(fresh) != whole

        other = ResumableSampler(dataset, batch_size + 1, seed=seed, num_replicas=num_replicas, rank=rank)
        with pytest.raises(ValueError, match=f"batch_size {batch_size} -> {batch_size + 1}"):
            other.load_state_dict(state)


SLOW_SAVE = """
import sys, time
import torch
from lit_thresh import checkpoint_io
path = sys.argv[1]
io = checkpoint_io.AtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "w": torch.full((1000,), 1.0)}, path)

def slow_save(obj, f, **kwargs):  # writes a little, then hangs: the test kills the process here
    f.write(b"PK half a checkpoint")
    f.flush()
    time.sleep(120)

checkpoint_io.torch.save = slow_save
io.save_checkpoint({"global_step": 2, "w": torch.full((1000,), 2.0)}, path)
"""


def test_kill_during_save_keeps_the_last_complete_checkpoint(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    saver = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], env=environment(), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (path.exists() and any(p.stat().st_size for p in temporary_files(path))):  # 2nd save under way
        assert saver.poll() is None, saver.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.02)
    saver.send_signal(signal.SIGKILL)
    saver.wait(timeout=30)

    assert saver.returncode == -signal.SIGKILL and len(temporary_files(path)) == 1
    first = torch.load(path, map_location="cpu", weights_only=True)
    assert first["global_step"] == 1 and torch.equal(first["w"], torch.full((1000,), 1.0))
    weights = torch.randn(1000)
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "w": weights}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], weights) and not temporary_files(path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]



def test_last_checkpoint_follows_every_validation_even_without_a_new_best(tmp_path, monkeypatch):
    """Lightning's own save_last rewrites last.ckpt only with a new best; here it follows every epoch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(NAN_TINY)
    main(
        [
            "fit", "--config", "tiny.yaml", "--trainer.max_epochs", "3",
            "--step_checkpoint.every_n_train_steps", "0",  # no step saves: only validation / epoch ends
            "--checkpoint.monitor", "n_params", "--checkpoint.mode", "max",  # constant: a best once, never again
            "--checkpoint.save_on_train_epoch_end", "true",  # n_params is logged in training, not validation
        ]
    )
    checkpoints = tmp_path / "lightning_logs/nan/version_0/checkpoints"
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    best = [p for p in checkpoints.iterdir() if p.name != "last.ckpt"]
    assert len(best) == 1 and torch.load(best[0], map_location="cpu", weights_only=True)["global_step"] == 8
    assert last["global_step"] == 24  # 3 epochs of 8 steps
