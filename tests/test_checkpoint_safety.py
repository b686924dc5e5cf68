"""A checkpoint is data, never code: every entry point that takes one reads it with ``weights_only=True``
and refuses, in one line naming the file, a damaged one or one whose pickle would run code; and one run
directory is written by one fit at a time (RunLock)."""

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from lit_thresh import generate
from lit_thresh.checkpoint_io import AtomicCheckpointIO
from lit_thresh.cli import main
from lit_thresh.resume import LOCK_NAME, RunLock, read_checkpoint
from tests.test_nan_guard import TINY

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

MARKER_ENV = "LIT_THRESH_TEST_MARKER"


def _write_marker() -> None:
    Path(os.environ[MARKER_ENV]).write_text("the checkpoint ran code")


class Payload:
    """Unpickling it calls _write_marker: what a hostile checkpoint would do."""

    def __reduce__(self):
        return (_write_marker, ())


def hostile_checkpoint(path: Path) -> Path:
    """A zip checkpoint, as torch.save writes it, whose pickle calls _write_marker when loaded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.randn(3)}, "global_step": 1, "payload": Payload()}, path)
    return path


def damaged(kind: str, path: Path) -> Path:
    """A file named like a checkpoint that is not one: `kind` of damage."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random_bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        buffer = io.BytesIO()
        torch.save({"state_dict": {"w": torch.randn(1000)}, "global_step": 3}, buffer)
        path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    elif kind == "zip_not_a_checkpoint":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "a zip file, not a checkpoint")
    elif kind == "not_a_lightning_checkpoint":
        torch.save({"weights": torch.randn(3)}, path)  # no state_dict
    return path


DAMAGE = {
    "empty": "empty",
    "random_bytes": "not a checkpoint",
    "truncated": "not a checkpoint",
    "zip_not_a_checkpoint": "not a checkpoint torch.load reads",
    "not_a_lightning_checkpoint": "not a Lightning checkpoint",
}


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "marker.txt"
    monkeypatch.setenv(MARKER_ENV, str(path))
    return path


def test_torch_load_without_weights_only_would_run_the_payload(tmp_path, marker):
    """The test's hostile checkpoint is real: an unsafe load runs its code."""
    torch.load(hostile_checkpoint(tmp_path / "evil.ckpt"), weights_only=False)
    assert marker.read_text() == "the checkpoint ran code"


def test_read_checkpoint_refuses_code(tmp_path, marker):
    path = hostile_checkpoint(tmp_path / "evil.ckpt")
    with pytest.raises(ValueError, match=rf"^{path}: refused: .* run as code"):
        read_checkpoint(path)
    assert not marker.exists()


def test_the_checkpoint_io_loads_data_only(tmp_path, marker):
    """What Lightning's Trainer loads goes through AtomicCheckpointIO: weights_only unless asked otherwise."""
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(hostile_checkpoint(tmp_path / "evil.ckpt"))
    assert not marker.exists()
    weights = torch.randn(3)
    torch.save({"state_dict": {"w": weights}}, tmp_path / "good.ckpt")
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(tmp_path / "good.ckpt")["state_dict"]["w"], weights)


@pytest.mark.parametrize("kind", DAMAGE)
def test_read_checkpoint_names_the_damaged_file(tmp_path, kind):
    path = damaged(kind, tmp_path / "x.ckpt")
    with pytest.raises(ValueError) as error:
        read_checkpoint(path)
    assert str(error.value).startswith(f"{path}: ") and DAMAGE[kind] in str(error.value)
    assert "\n" not in str(error.value)


def lit_thresh(*args: str) -> str:
    """`lit_thresh <args>` in-process on the tiny NaN-guard config; returns its error line."""
    with pytest.raises(SystemExit) as error:
        main([args[0], "--config", "tiny.yaml", *args[1:]])
    message = str(error.value.code)
    assert message.startswith("lit_thresh: error: ") and "\n" not in message
    return message


LAST = Path("lightning_logs/nan/version_0/checkpoints/last.ckpt")  # where TINY's runs keep last.ckpt


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_every_subcommand_refuses_code(tmp_path, monkeypatch, marker, subcommand):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    path = hostile_checkpoint(tmp_path / "evil.ckpt")
    assert lit_thresh(subcommand, f"--ckpt_path={path}").startswith(f"lit_thresh: error: {path}: refused")
    hostile_checkpoint(LAST)
    assert lit_thresh(subcommand, "--ckpt_path=last").startswith(f"lit_thresh: error: {LAST}: refused")
    assert not marker.exists()
    assert sorted(p.name for p in LAST.parent.parent.iterdir()) == ["checkpoints"]  # no run started


@pytest.mark.parametrize("kind", DAMAGE)
def test_ckpt_path_last_names_a_damaged_last_checkpoint(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    damaged(kind, LAST)
    message = lit_thresh("fit", "--ckpt_path=last")
    assert message.startswith(f"lit_thresh: error: {LAST}: ") and DAMAGE[kind] in message


def test_weights_only_false_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    assert "weights_only false would let a checkpoint run code" in lit_thresh("validate", "--weights_only=false")


def test_generate_refuses_code(tmp_path, marker, capsys):
    path = hostile_checkpoint(tmp_path / "evil.ckpt")
    with pytest.raises(SystemExit) as error:
        generate.main([f"--run_config={tmp_path / 'config.yaml'}", f"--ckpt_path={path}"])
    assert str(error.value.code).startswith(f"lit_thresh.generate: error: {path}: refused")
    assert not marker.exists()


def test_a_held_run_directory_is_refused(tmp_path):
    first, second = RunLock(tmp_path / "version_0"), RunLock(tmp_path / "version_0")
    first.acquire()
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'version_0'}: another lit_thresh run is writing"):
        second.acquire()
    first.release()
    second.acquire()  # free again once the first run ended
    second.release()
    assert (tmp_path / "version_0" / LOCK_NAME).is_file()
