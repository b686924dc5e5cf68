"""The ``lit_thresh`` command on CPU: the installed script run as a user runs it (subprocesses), and its
parser in-process."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from lit_thresh.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

CONFIGS = Path(__file__).parents[1] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
# The quickstart, shrunk to one epoch of 2 steps on CPU.
TINY_MQAR = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=1",
    "--data.init_args.train=[{seq_len: 32, num_kv_pairs: 4, num_examples: 32}]",
    "--data.init_args.val=[{seq_len: 32, num_kv_pairs: 4, num_examples: 32}]",
    "--data.init_args.batch_size=16",
]


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the installed command on CPU with the PyTorch kernels (no Triton interpreter), offline."""
    command = shutil.which("lit_thresh", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar logged to TensorBoard in run_dir, by tag."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """A tiny quickstart fit; returns its working directory."""
    cwd = tmp_path_factory.mktemp("fit")
    run_cli("fit", "--config", str(QUICKSTART), *TINY_MQAR, cwd=cwd)
    return cwd


def test_fit_writes_logs_config_and_checkpoints(fitted):
    run = fitted / "lightning_logs" / "quickstart" / "version_0"
    assert list(run.glob("events.out.tfevents.*"))
    logged = scalars(run)
    assert {"train/loss", "val/loss", "val/acc", "val/ppl"} <= logged.keys()

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["seed_everything"] == 1234
    assert config["model"]["attention"]["class_path"] == "lit_thresh.attention.ThresholdAttention"
    assert config["model"]["key_conv"] == 2
    assert config["data"]["class_path"] == "lit_thresh.data.MQARDataModule"

    checkpoints = {p.name for p in (run / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and len(checkpoints) == 2  # last + best on val/acc

    events = EventAccumulator(str(run))
    events.Reload()
    experiment = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    metrics = plugin_data_pb2.HParamsPluginData.FromString(experiment).experiment.metric_infos
    assert {"val/acc", "val/loss"} <= {m.name.tag for m in metrics}


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_subcommands_from_checkpoint(fitted, subcommand):
    ckpt = fitted / "lightning_logs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    # a fixed logger version: rerunning into an existing run directory must not be blocked
    args = ["--config", str(QUICKSTART), *TINY_MQAR, "--ckpt_path", str(ckpt), "--trainer.logger.init_args.version=0"]
    result = run_cli(subcommand, *args, cwd=fitted)
    metric = {"validate": "val/acc", "test": "test/acc", "predict": "Predicting"}[subcommand]
    assert metric in result.stdout


def test_python_m_help(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "lit_thresh", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert all(sub in result.stdout for sub in ("fit", "validate", "test", "predict"))


def print_config(*args: str, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_fit_help(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--model.attention" in out and "--checkpoint.monitor" in out and "--data CONFIG" in out


def test_configs_compose(tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  d_model: 32\ntrainer:\n  max_epochs: 3\n")
    pieces = ["--config", str(QUICKSTART), "--config", str(override), "--data", str(CONFIGS / "data/mqar.yaml")]
    config = print_config(*pieces, capsys=capsys)
    assert config["model"]["d_model"] == 32 and config["model"]["n_layers"] == 2  # merged, not replaced
    assert config["trainer"]["max_epochs"] == 3
    assert config["trainer"]["logger"]["init_args"]["name"] == "quickstart"
    assert config["data"]["init_args"]["vocab_size"] == 8192  # the data piece
    assert config["seed_everything"] == 1234


def test_defaults(capsys):
    config = print_config("--data", "lit_thresh.data.MQARDataModule", capsys=capsys)
    assert config["seed_everything"] == 1234
    assert config["trainer"]["precision"] == "32-true"  # no GPU here
    assert config["trainer"]["logger"]["init_args"]["default_hp_metric"] is False
    assert config["checkpoint"]["save_last"] is None  # step_checkpoint owns last.ckpt
    assert config["step_checkpoint"]["every_n_train_steps"] == 500


@pytest.fixture
def omp_num_threads(monkeypatch):
    """Sets OMP_NUM_THREADS (None: unset) for the test, with torch at 2 CPU threads; restores them after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    def set_env(value: str | None) -> None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        if value is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", value)

    yield set_env
    torch.set_num_threads(before)


@pytest.mark.parametrize("devices,env,threads", [(2, None, 1), (2, "3", None), (1, None, None)])
def test_one_cpu_thread_per_process_under_several_devices(omp_num_threads, devices, env, threads):
    """As torchrun: several devices and OMP_NUM_THREADS unset -> 1 CPU thread per process; otherwise (one
    CPU process, or OMP_NUM_THREADS set) the thread count is left alone (None)."""
    from lit_thresh.cli import build_cli

    omp_num_threads(env)
    args = ["--data", "lit_thresh.data.MQARDataModule", "--trainer.accelerator", "cpu"]
    build_cli([*args, "--trainer.devices", str(devices), "--trainer.strategy", "ddp"], run=False)
    assert torch.get_num_threads() == (threads or 2)


@pytest.mark.parametrize("env,threads", [(None, 1), ("3", None)])
def test_one_cpu_thread_for_a_process_on_a_gpu(omp_num_threads, env, threads):
    """One process on one GPU also gets 1 CPU thread (OMP_NUM_THREADS unset): its CPU only queues kernels."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    from lit_thresh.cli import one_thread_per_process

    omp_num_threads(env)
    one_thread_per_process(SimpleNamespace(num_devices=1, accelerator=CUDAAccelerator()))
    assert torch.get_num_threads() == (threads or 2)
