"""`python -m lit_thresh.generate` on a tiny text run, and decoding past a learned-position window."""

import os
import subprocess
import sys

import pytest
import torch

from lit_thresh.attention import ThresholdAttention
from lit_thresh.generate import SEPARATOR
from lit_thresh.generate import main as generate_main
from lit_thresh.model import Transformer, TransformerConfig
from tests.tiny_runs import fit_tiny_text_run

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


def test_greedy_decoding_past_max_seq_len_matches_a_sliding_full_recompute():
    """Learned positions: once past max_seq_len, each step sees the last max_seq_len tokens (nanoGPT)."""
    torch.manual_seed(0)
    config = TransformerConfig(37, 32, 2, 2, attention=ThresholdAttention, positional="learned", max_seq_len=12)
    model = Transformer(config).double().eval()
    prompt = torch.randint(0, 37, (2, 5))
    out = model.generate(prompt, 20, temperature=0)
    expected = prompt
    for _ in range(20):
        logits = model(expected[:, -12:])[:, -1]
        expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)


@pytest.mark.slow
def test_generate_entry_samples_from_a_checkpoint(tmp_path, monkeypatch):
    run = fit_tiny_text_run(tmp_path, monkeypatch, "--data.block_size=16", "--data.batch_size=4",
                            "--data.val_samples=8", "--model.config.n_layers=1")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "lit_thresh.generate", f"--run_config={run / 'config.yaml'}",
         f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "--prompt=to be", "--max_new_tokens=30",
         "--num_samples=2", "--top_k=5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    samples = result.stdout.split(f"\n{SEPARATOR}\n")[:-1]
    assert len(samples) == 2
    assert all(s.startswith("to be") and len(s) == len("to be") + 30 for s in samples)  # char tokenizer
    assert set("".join(samples)) <= set((tmp_path / "input.txt").read_text())

    assert len(result.stderr) < 300, result.stderr  # no LightningCLI warning or start-up messages

    def error(*args: str) -> str:
        """python -m lit_thresh.generate's one-line error for args (in-process)."""
        with pytest.raises(SystemExit) as exit_info:
            ckpt = run / "checkpoints" / "last.ckpt"
            generate_main([f"--run_config={run / 'config.yaml'}", f"--ckpt_path={ckpt}", *args])
        message = str(exit_info.value.code)
        assert message.startswith("lit_thresh.generate: error: ") and "\n" not in message
        return message

    assert "prompt: character 'Z' is not in the vocabulary" in error("--prompt=to Z")
    assert "prompt must not be empty" in error("--prompt=")
    assert "max_new_tokens must be >= 0, got -1" in error("--max_new_tokens=-1")
    assert "num_samples must be >= 1, got 0" in error("--num_samples=0")
    assert "top_k must be >= 1" in error("--top_k=0")
    assert "temperature must be a finite float >= 0" in error("--temperature=-0.5")
    assert "nope.ckpt: no such checkpoint file" in error("--ckpt_path=nope.ckpt")
    assert "config.yaml" in error(f"--run_config={tmp_path / 'config.yaml'}")  # no such file

    missing = subprocess.run(
        [sys.executable, "-m", "lit_thresh.generate", f"--run_config={run / 'config.yaml'}", "--ckpt_path=nope.ckpt"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert missing.returncode == 1
    assert missing.stderr.strip() == "lit_thresh.generate: error: nope.ckpt: no such checkpoint file"
    unknown = subprocess.run(
        [sys.executable, "-m", "lit_thresh.generate", "--max_new_token=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert unknown.returncode == 2 and "--max_new_token" in unknown.stderr and len(unknown.stderr.splitlines()) <= 3
