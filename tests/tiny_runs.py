"""A tiny `lit_thresh fit` of the char threshold config on generated text, for the tests of commands that read a
trained run (python -m lit_thresh.generate, python -m lit_thresh.trained_maps)."""

import random
from pathlib import Path

import pytest

from lit_thresh.cli import main

CONFIGS = Path(__file__).parents[1] / "configs"
WORDS = ["to", "be", "or", "not", "that", "is", "the", "question"]


def fit_tiny_text_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Path:
    """Fits 2 steps on CPU in tmp_path (the working directory from then on) on 300 lines of random words, without
    TRITON_INTERPRET (the PyTorch path, as on a CPU machine); args: more options. Returns the run's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = random.Random(0)
    (tmp_path / "input.txt").write_text("\n".join(" ".join(rng.choices(WORDS, k=10)) for _ in range(300)))
    main([
        "fit", "--config", str(CONFIGS / "text" / "shakespeare_char_threshold.yaml"), "--data.data_files=input.txt",
        "--model.config.d_model=24", "--model.config.n_heads=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        "--model.compile=false",  # the config's torch.compile: 16-67 s of CPU here; tests/test_module.py covers it
        *args,
    ])
    return next(tmp_path.glob("lightning_logs/*/version_0"))
