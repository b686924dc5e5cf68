"""The ``lit_thresh`` command on CPU: the installed script run as a user runs it (subprocesses), and its
parser in-process."""

import os
import shutil
import signal
import subprocess
import sys
import time
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


def command_line(*args: str) -> list[str]:
    """The installed command with `args`."""
    return [shutil.which("lit_thresh", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"), *args]


# The command's environment: the PyTorch kernels on CPU (no Triton interpreter), offline.
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"HF_DATASETS_OFFLINE": "1"}


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the installed command; fails unless it exits with 0."""
    result = subprocess.run(command_line(*args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar logged to TensorBoard in run_dir, by tag."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """A tiny quickstart fit; returns its working directory, where fit.log holds what it printed."""
    cwd = tmp_path_factory.mktemp("fit")
    result = run_cli("fit", "--config", str(QUICKSTART), *TINY_MQAR, "--progress_log.every_n_steps=1", cwd=cwd)
    (cwd / "fit.log").write_text(result.stdout + result.stderr)
    return cwd


@pytest.mark.slow
def test_fit_prints_no_noise_and_logs_progress_off_a_terminal(fitted):
    printed = (fitted / "fit.log").read_text()
    for noise in ("GPU available", "TPU available", "litlogger", "LeafSpec", "FLOPs", "v_num"):
        assert noise not in printed
    assert "step 1/2 | epoch 0 | loss " in printed and "step 2/2 | epoch 0 | loss " in printed  # not a TTY
    assert "tokens/s | ETA 0:00:00" in printed


@pytest.mark.slow
def test_fit_writes_logs_config_and_checkpoints(fitted):
    run = fitted / "lightning_logs" / "quickstart" / "version_0"
    assert list(run.glob("events.out.tfevents.*"))
    logged = scalars(run)
    assert {"train/loss", "val/loss", "val/acc", "val/ppl"} <= logged.keys()

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["seed_everything"] == 1234
    assert config["model"]["config"]["attention"]["class_path"] == "lit_thresh.attention.ThresholdAttention"
    assert config["model"]["config"]["key_conv"] == 2
    assert config["data"]["class_path"] == "lit_thresh.data.MQARDataModule"

    checkpoints = {p.name for p in (run / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and len(checkpoints) == 2  # last + best on val/acc

    events = EventAccumulator(str(run))
    events.Reload()
    experiment = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    metrics = plugin_data_pb2.HParamsPluginData.FromString(experiment).experiment.metric_infos
    assert {"val/acc", "val/loss"} <= {m.name.tag for m in metrics}


@pytest.mark.slow
@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_subcommands_from_checkpoint(fitted, subcommand):
    """Into the fit's own directory: the fit's config.yaml stays as it was, the subcommand keeps its own
    config_<subcommand>.yaml; validate and test print one table (a column per data set)."""
    run = fitted / "lightning_logs" / "quickstart" / "version_0"
    fit_config = (run / "config.yaml").read_bytes()
    # a fixed logger version: rerunning into an existing run directory must not be blocked
    ckpt = run / "checkpoints" / "last.ckpt"
    args = ["--config", str(QUICKSTART), *TINY_MQAR, "--ckpt_path", str(ckpt), "--trainer.logger.init_args.version=0"]
    result = run_cli(subcommand, *args, cwd=fitted)
    assert (run / "config.yaml").read_bytes() == fit_config
    own = yaml.safe_load((run / f"config_{subcommand}.yaml").read_text())
    assert own["ckpt_path"] == str(ckpt)
    if subcommand == "predict":
        assert "Predicting" in result.stdout
        return
    split = {"validate": "val", "test": "test"}[subcommand]
    assert result.stdout.count(f"{split} metrics") == 1 and "DataLoader" not in result.stdout
    header = next(line for line in result.stdout.splitlines() if "┃ metric" in line)
    assert header.split("┃")[2].strip() == split  # the first data set's column
    if subcommand == "test":  # one column per test set (the quickstart: 2x, 4x, 8x the training length)
        assert "len64_n4" in header and "len256_n4" in header


@pytest.mark.slow
def test_rerunning_a_run_config_starts_a_new_run(fitted):
    run = fitted / "lightning_logs" / "quickstart" / "version_0"
    run_cli("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps=1", cwd=fitted)
    assert (fitted / "lightning_logs" / "quickstart" / "version_1" / "config.yaml").is_file()


@pytest.mark.slow
def test_sigterm_stops_a_fit_with_a_resumable_checkpoint_and_a_failure_status(tmp_path):
    """SIGTERM after the 2nd step: last.ckpt holds the steps done, the exit status is 143 (128 + SIGTERM)."""
    args = ["fit", "--config", str(QUICKSTART), *TINY_MQAR, "--progress_log.every_n_steps=1"]
    args += ["--data.init_args.train=[{seq_len: 32, num_kv_pairs: 4, num_examples: 20000}]"]  # long enough
    with (tmp_path / "fit.log").open("w") as log:
        fit = subprocess.Popen(command_line(*args), cwd=tmp_path, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while "step 2/" not in (tmp_path / "fit.log").read_text() and fit.poll() is None:
                assert time.monotonic() < deadline, "the fit did not reach step 2"
                time.sleep(0.2)
            fit.send_signal(signal.SIGTERM)
            returncode = fit.wait(timeout=120)
        finally:
            if fit.poll() is None:
                fit.kill()
                fit.wait()
    printed = (tmp_path / "fit.log").read_text()
    assert returncode == 143, printed[-3000:]
    assert "fit stopped by SIGTERM" in printed and "--ckpt_path last" in printed
    ckpt = torch.load(
        tmp_path / "lightning_logs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False
    )
    assert ckpt["global_step"] >= 2


@pytest.mark.slow
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
    assert "--model.config.attention" in out and "--checkpoint.monitor" in out and "--data CONFIG" in out


def test_configs_compose(tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  config:\n    d_model: 32\ntrainer:\n  max_epochs: 3\n")
    pieces = ["--config", str(QUICKSTART), "--config", str(override), "--data", str(CONFIGS / "data/mqar.yaml")]
    config = print_config(*pieces, capsys=capsys)
    model = config["model"]["config"]
    assert model["d_model"] == 32 and model["n_layers"] == 2  # merged, not replaced
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


def test_default_callbacks_print_and_switch_off(capsys):
    """Every default callback is a config group that --print_config shows, and null switches it off."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lit_thresh.callbacks import NaNGuard
    from lit_thresh.cli import DEFAULT_CALLBACKS, build_cli

    config = print_config("--config", str(QUICKSTART), capsys=capsys)
    for key, (callback, _) in DEFAULT_CALLBACKS.items():
        assert config[key]["class_path"].rsplit(".", 1)[1] == callback.__name__, key
    assert config["lr_monitor"]["init_args"]["logging_interval"] == "step"

    args = ["--data", "lit_thresh.data.MQARDataModule", "--trainer.accelerator", "cpu"]
    on = {type(c) for c in build_cli(args, run=False).trainer.callbacks}
    assert {NaNGuard, LearningRateMonitor} <= on
    off_args = [*args, "--nan_guard", "null", "--lr_monitor", "null"]
    off = {type(c) for c in build_cli(off_args, run=False).trainer.callbacks}
    assert on - off == {NaNGuard, LearningRateMonitor}


@pytest.mark.parametrize("save_dir", [None, "elsewhere"])
def test_default_root_dir_moves_the_logs_unless_save_dir_is_set(tmp_path, save_dir):
    from lit_thresh.cli import build_cli

    args = ["--data", "lit_thresh.data.MQARDataModule", "--trainer.accelerator", "cpu"]
    args += ["--trainer.default_root_dir", str(tmp_path)]
    if save_dir:
        args.append(f"--trainer.logger.init_args.save_dir={save_dir}")
    logger = build_cli(args, run=False).trainer.logger
    assert logger.save_dir == (save_dir or str(tmp_path / "lightning_logs"))


def test_test_and_validate_have_no_verbose_option(capsys):
    """Lightning's per-DataLoader tables are replaced by MetricsTable's one: no --verbose to bring them back."""
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--verbose", "true"])
    assert exit_info.value.code == 2
    assert "--verbose" in capsys.readouterr().err
