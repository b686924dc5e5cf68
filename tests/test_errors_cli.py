"""Bad input to the ``lit_thresh`` command: each case ends with a non-zero exit and one short message naming
the culprit (no traceback, no hang), and a run pointed at an existing run's directory leaves that run's
files as they were.

Every case runs `lit_thresh.cli.main` in-process (a subprocess per case would spend ~5 s of CPU each on
imports); the installed command itself, run as a user runs it, is checked on one error of each kind.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

from lit_thresh.cli import main
from tests.test_cli import QUICKSTART, TINY_MQAR

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

RUN_DIR = Path("lightning_logs/quickstart/version_0")  # the existing run, inside each case's directory
CKPT = str(RUN_DIR / "checkpoints" / "last.ckpt")
INTO_RUN = "--trainer.logger.init_args.version=0"  # write into the existing run's directory
TIMEOUT = 120  # seconds; a command that hangs fails


class Case(NamedTuple):
    args: list[str]  # after `lit_thresh`
    returncode: int
    says: list[str]  # substrings of the message
    files: dict[str, str] = {}  # written into the case's directory first


def fit(*args: str) -> list[str]:
    return ["fit", "--config", str(QUICKSTART), *TINY_MQAR, *args]


def validate(*args: str) -> list[str]:
    return ["validate", "--config", str(QUICKSTART), *TINY_MQAR, *args]


CASES = {
    "malformed_yaml": Case(
        fit("--config", "bad.yaml", INTO_RUN),
        2,
        ["bad.yaml", "not valid YAML", "line 3"],
        {"bad.yaml": "model:\n  config:\n    d_model: [64\n"},
    ),
    "unknown_key_in_yaml": Case(
        fit("--config", "typo.yaml", INTO_RUN),
        2,
        ["model.config.d_modle"],
        {"typo.yaml": "model:\n  config:\n    d_modle: 32\n"},
    ),
    "unknown_key_on_command_line": Case(fit("--trainer.max_epoch=1", INTO_RUN), 2, ["--trainer.max_epoch"]),
    "wrong_type": Case(fit("--model.config.d_model=abc", INTO_RUN), 2, ['"model.config.d_model"', "int", "abc"]),
    "unknown_attention_variant": Case(
        fit("--model.config.attention=FooAttention", INTO_RUN),
        2,
        ['"model.config.attention"', "FooAttention", "ThresholdAttention", "--model.config.attention.help"],
    ),
    "head_dim_over_256": Case(
        fit("--model.config.d_model=512", "--model.config.n_heads=1", INTO_RUN),
        1,
        ["ThresholdAttention", "head dims up to 256", "512 / 1 = 512"],
    ),
    "d_model_not_divisible_by_heads": Case(
        fit("--model.config.n_heads=3", INTO_RUN), 1, ["d_model (64)", "n_heads (3)"]
    ),
    "rope_with_odd_head_dim": Case(
        fit("--model.config.positional=rope", "--model.config.d_model=6", "--model.config.n_heads=2", INTO_RUN),
        1,
        ["positional='rope'", "even", "got 3"],
    ),
    "seq_len_too_short_for_the_pairs": Case(
        fit("--data.init_args.train=[{seq_len: 8, num_kv_pairs: 4, num_examples: 32}]", INTO_RUN),
        1,
        ["seq_len must be >= 4 * num_kv_pairs", "got 8"],
    ),
    # Learned positions cannot take the 2x-length test sets: found before any run directory is written,
    # so a run pointed at the existing one leaves its config.yaml alone.
    "learned_positions_shorter_than_test_length": Case(
        fit("--model.config.positional=learned", "--data.init_args.test_length_multipliers=[2]", INTO_RUN),
        1,
        ["positional='learned'", "64 tokens", "training on 32"],
    ),
    "sigterm_interval_zero": Case(
        fit("--sigterm.every_n_batches=0", INTO_RUN), 1, ["every_n_batches must be an int >= 1", "got 0"]
    ),
    "progress_log_interval_zero": Case(
        fit("--progress_log.every_n_steps=0", INTO_RUN), 1, ["every_n_steps must be an int >= 1", "got 0"]
    ),
    "throughput_window_of_one": Case(
        fit("--throughput.window_size=1", INTO_RUN), 1, ["window_size must be an int >= 2", "got 1"]
    ),
    "new_fit_into_an_existing_run": Case(fit(INTO_RUN), 1, ["already holds a run (config.yaml)", "--ckpt_path"]),
    # Found once the fit has started (the DataModule's prepare_data), so in a run directory of its own: a
    # new fit pointed at the existing run is refused before that (already holds a run).
    "missing_data_file": Case(
        fit(
            "--data=lit_thresh.data.TextDataModule",
            "--data.init_args.tokenizer=lit_thresh.data.tokenizers.ByteTokenizer",
            "--data.init_args.data_files=missing.txt",
            "--trainer.default_root_dir=fresh",  # its logs under fresh/lightning_logs
        ),
        1,
        ["data_files", "missing.txt"],
    ),
    "missing_ckpt_path": Case(validate("--ckpt_path=nope.ckpt", INTO_RUN), 1, ["nope.ckpt: no such checkpoint file"]),
    "ckpt_path_of_another_attention": Case(  # softmax weights, a threshold attention config
        validate(f"--ckpt_path={CKPT}", INTO_RUN),
        1,
        [CKPT, "belongs to a different model", "model.blocks.0.attn.threshold.beta missing"],
    ),
    "ckpt_path_of_another_vocabulary": Case(  # 128 tokens in the checkpoint, 64 in the data
        validate(
            "--model.config.attention=SoftmaxAttention",
            "--data.init_args.vocab_size=64",
            f"--ckpt_path={CKPT}",
            INTO_RUN,
        ),
        1,
        [CKPT, "belongs to a different model", "model.token_emb.weight (128, 64) where the model has (64, 64)"],
    ),
    "ckpt_path_not_a_checkpoint": Case(
        validate(f"--ckpt_path={RUN_DIR / 'config.yaml'}", INTO_RUN), 1, ["config.yaml: not a checkpoint"]
    ),
    # Found before any run directory is written (after_instantiate_classes), not once the run has started.
    "negative_lr": Case(
        fit("--model.optimizer.init_args.lr=-0.1", INTO_RUN), 1, ["model.optimizer", "Invalid learning rate: -0.1"]
    ),
    "nan_lr": Case(
        fit("--model.optimizer.init_args.lr=.nan", INTO_RUN), 1, ["model.optimizer", "learning rate: nan"]
    ),
    "infinite_lr": Case(
        fit("--model.optimizer.init_args.lr=.inf", INTO_RUN), 1, ["model.optimizer: lr must be finite"]
    ),
    "nan_betas": Case(fit("--model.optimizer.init_args.betas=[.nan, 0.99]", INTO_RUN), 1, ["model.optimizer", "beta"]),
    "negative_min_lr_ratio": Case(
        fit("--model.lr_scheduler.init_args.min_lr_ratio=-1", INTO_RUN), 1, ["model.lr_scheduler", "min_lr_ratio"]
    ),
    "val_check_interval_longer_than_the_epoch": Case(  # 32 examples in batches of 16: 2 per epoch
        fit("--trainer.val_check_interval=5", INTO_RUN),
        1,
        ["trainer.val_check_interval (5 batches) is longer than an epoch (2 training batches)"],
    ),
}


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under directory: (sha256 of its bytes, modification time in ns), by relative path."""
    return {
        str(path.relative_to(directory)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def run_main(args: list[str], capfd) -> tuple[int, str]:
    """main(args) in-process: its exit status and stderr as the command's (a SystemExit carrying a
    message prints it and exits 1, as the interpreter does). The environment is restored afterwards."""
    with mock.patch.dict(os.environ):
        try:
            main(args)
            status = 0
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return status, capfd.readouterr().err


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    """A directory holding a finished tiny run (softmax attention: in-process, without the Triton interpreter)."""
    cwd = tmp_path_factory.mktemp("existing")
    with pytest.MonkeyPatch.context() as patch, mock.patch.dict(os.environ):
        patch.chdir(cwd)
        main(fit("--model.config.attention=SoftmaxAttention", "--trainer.enable_progress_bar=false"))
    assert (cwd / CKPT).is_file()
    return cwd


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, existing_run, tmp_path, monkeypatch, capfd):
    case = CASES[name]
    shutil.copytree(existing_run, tmp_path, dirs_exist_ok=True)
    for file_name, text in case.files.items():
        (tmp_path / file_name).write_text(text)
    before = snapshot(tmp_path / "lightning_logs")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    status, stderr = run_main(case.args, capfd)

    assert status == case.returncode, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith(("error:", "lit_thresh: error:"))]
    assert len(errors) == 1, stderr
    assert len(lines) <= 10, stderr  # Lightning's few start-up lines at most, no wall
    message = stderr[stderr.index(errors[0]) :]
    for text in case.says:
        assert text in message, message

    after = snapshot(tmp_path / "lightning_logs")
    assert {path: after.get(path) for path in before} == before  # not a byte nor a time stamp changed
    assert sorted(set(after) - set(before)) == []  # nothing written at all


COMMANDS = {  # the installed command's runs: (case, extra environment)
    "parse_error": ("malformed_yaml", {}),
    "input_error": ("d_model_not_divisible_by_heads", {}),
    "input_error_with_traceback": ("d_model_not_divisible_by_heads", {"LIT_THRESH_TRACEBACK": "1"}),
}


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The installed command, as test_cli.run_cli runs it, on COMMANDS (all at once, each in its own
    empty directory): run name -> (the finished process, its directory)."""
    executable = shutil.which("lit_thresh", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    base_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIT_THRESH_TRACEBACK")}
    started = {}
    for run, (name, env) in COMMANDS.items():
        cwd = tmp_path_factory.mktemp(run)
        for file_name, text in CASES[name].files.items():
            (cwd / file_name).write_text(text)
        process = subprocess.Popen(
            [executable, *CASES[name].args], cwd=cwd, env=base_env | env, stderr=subprocess.PIPE, text=True
        )
        started[run] = (process, cwd)
    finished = {}
    for run, (process, cwd) in started.items():
        _, stderr = process.communicate(timeout=TIMEOUT)
        finished[run] = (subprocess.CompletedProcess(process.args, process.returncode, None, stderr), cwd)
    return finished


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "first_line"), [("parse_error", "usage: lit_thresh fit [options]"), ("input_error", "Seed set to 1234")]
)
def test_the_command_prints_one_message(commands, run, first_line):
    case = CASES[COMMANDS[run][0]]
    result, cwd = commands[run]
    assert result.returncode == case.returncode
    lines = result.stderr.strip().splitlines()
    assert lines[0] == first_line and len(lines) <= 3, result.stderr
    assert lines[-1].startswith("error:" if case.returncode == 2 else "lit_thresh: error:")
    assert all(text in lines[-1] for text in case.says), result.stderr
    assert not (cwd / "lightning_logs").exists()


@pytest.mark.slow
def test_the_command_shows_the_traceback_on_request(commands):
    result, _ = commands["input_error_with_traceback"]
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ValueError: d_model (64) must be divisible by n_heads (3)"
