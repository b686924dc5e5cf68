"""Sample text from a trained run, decoding with the model's KV cache.

    python -m lit_thresh.generate \\
        --run_config lightning_logs/shakespeare_char_softmax/version_0/config.yaml \\
        --ckpt_path lightning_logs/shakespeare_char_softmax/version_0/checkpoints/last.ckpt \\
        --prompt "ROMEO:" --max_new_tokens 300 --temperature 0.8 --top_k 50

The run's saved config rebuilds the model and its DataModule (whose tokenizer encodes the prompt and
decodes the samples); the checkpoint gives the weights, read with ``weights_only=True`` (one whose pickle
would run code is refused). Each new token costs O(T): the cache holds the keys and values, and threshold
attention decodes through the ops' Tq < Tk path. Bad input ends with one line,
``lit_thresh.generate: error: <message>`` (``LIT_THRESH_TRACEBACK=1``: the traceback).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from jsonargparse import auto_cli
from lightning.pytorch import LightningDataModule, LightningModule, seed_everything

from lit_thresh.cli import build_cli
from lit_thresh.cli_errors import Parser, exit_on_input_error
from lit_thresh.resume import check_state_dict, read_checkpoint

PROG = "lit_thresh.generate"
# Keys of a `fit` config that belong to the subcommand, not to the model, data or trainer.
_SUBCOMMAND_KEYS = ("ckpt_path", "weights_only")
SEPARATOR = "-" * 40  # printed after each sample


def check_sampling(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, num_samples: int) -> None:
    """Raises ValueError naming the first sampling argument out of range."""
    if not prompt:
        raise ValueError("prompt must not be empty (the model continues a prompt; the default is a newline)")
    for name, value, minimum in (("max_new_tokens", max_new_tokens, 0), ("num_samples", num_samples, 1)):
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, or null for no top-k cut, got {top_k}")


def read_run_config(run_config: Path) -> dict:
    """The model, data and trainer settings of a run's saved config.yaml (its subcommand keys dropped)."""
    try:
        config = yaml.safe_load(Path(run_config).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"run_config {run_config} is not valid YAML: {err}") from err
    if not isinstance(config, dict) or "model" not in config:
        raise ValueError(f"run_config {run_config} is not the config.yaml of a lit_thresh fit (it has no model)")
    return {key: value for key, value in config.items() if key not in _SUBCOMMAND_KEYS}


@contextmanager
def quiet() -> Iterator[None]:
    """Silences Lightning's start-up messages and LightningCLI's warning about its ``args`` parameter."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def load_run(run_config: Path, ckpt_path: Path, *args: str) -> tuple[LightningModule, LightningDataModule]:
    """The LightningModule of a run's saved config with the weights of one of its checkpoints, and its DataModule
    (not set up); args: more options for the config (e.g. "--model.compile=false")."""
    checkpoint = read_checkpoint(ckpt_path)
    config = read_run_config(run_config)
    with quiet():
        cli = build_cli([f"--config={yaml.safe_dump(config)}", "--trainer.logger=false", *args], run=False)
    model, data = cli.model, cli.datamodule
    check_state_dict(str(ckpt_path), checkpoint, model)
    model.load_state_dict(checkpoint["state_dict"])
    return model, data


def generate(
    run_config: Path,
    ckpt_path: Path,
    prompt: str = "\n",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    num_samples: int = 1,
    seed: int = 1337,
) -> list[str]:
    """Prints and returns num_samples continuations of prompt.

    Args:
        run_config: the config.yaml a `lit_thresh fit` run saved (model and data settings).
        ckpt_path: one of that run's checkpoints (e.g. its checkpoints/last.ckpt).
        prompt: the text to continue; every character must be in the data's vocabulary.
        max_new_tokens: tokens to add to the prompt (>= 0).
        temperature: softmax temperature (>= 0; 0 = greedy).
        top_k: sample among the k most likely tokens only (>= 1; null: all).
        num_samples: continuations to draw (>= 1).
        seed: the sampling seed.
    """
    check_sampling(prompt, max_new_tokens, temperature, top_k, num_samples)
    model, data = load_run(run_config, ckpt_path)
    try:
        prompt_ids = data.encode(prompt)
    except ValueError as err:
        raise ValueError(f"prompt: {err}") from err
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()

    seed_everything(seed, verbose=False)
    idx = torch.tensor([prompt_ids] * num_samples, device=device)  # (N, T)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)  # (N, T + new)
    samples = [data.decode(row.tolist()) for row in out]
    for sample in samples:
        print(f"{sample}\n{SEPARATOR}")
    return samples


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m lit_thresh.generate``: parse errors as the ``lit_thresh`` command's
    (a one-line usage, exit status 2), other bad input as ``lit_thresh.generate: error: ...`` (exit 1)."""
    with exit_on_input_error(PROG):
        auto_cli(
            generate, args=args, as_positional=False, parser_class=Parser, prog=f"python -m {PROG}", description=__doc__
        )


if __name__ == "__main__":
    main()
