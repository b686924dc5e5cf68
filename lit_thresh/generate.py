"""Sample text from a trained run, decoding with the model's KV cache.

    python -m lit_thresh.generate \\
        --run_config lightning_logs/shakespeare_char_softmax/version_0/config.yaml \\
        --ckpt_path lightning_logs/shakespeare_char_softmax/version_0/checkpoints/last.ckpt \\
        --prompt "ROMEO:" --max_new_tokens 300 --temperature 0.8 --top_k 50

The run's saved config rebuilds the model and its DataModule (whose tokenizer encodes the prompt and
decodes the samples); the checkpoint gives the weights. Each new token costs O(T): the cache holds the
keys and values, and threshold attention decodes through the ops' Tq < Tk path.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from jsonargparse import auto_cli
from lightning.pytorch import seed_everything

from lit_thresh.cli import build_cli

# Keys of a `fit` config that belong to the subcommand, not to the model, data or trainer.
_SUBCOMMAND_KEYS = ("ckpt_path", "weights_only")
SEPARATOR = "-" * 40  # printed after each sample


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
    """Prints and returns num_samples continuations of prompt (temperature 0 = greedy).

    run_config: the config.yaml a `lit_thresh fit` run saved; ckpt_path: one of its checkpoints.
    """
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path: no checkpoint at {ckpt_path}")
    run_config = {k: v for k, v in yaml.safe_load(Path(run_config).read_text()).items() if k not in _SUBCOMMAND_KEYS}
    cli = build_cli([f"--config={yaml.safe_dump(run_config)}", "--trainer.logger=false"], run=False)
    model, data = cli.model, cli.datamodule
    model.load_state_dict(torch.load(ckpt_path, map_location="cpu", weights_only=False)["state_dict"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()

    seed_everything(seed, verbose=False)
    idx = torch.tensor([data.encode(prompt)] * num_samples, device=device)  # (N, T)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)  # (N, T + new)
    samples = [data.decode(row.tolist()) for row in out]
    for sample in samples:
        print(f"{sample}\n{SEPARATOR}")
    return samples


def main() -> None:
    auto_cli(generate, as_positional=False)


if __name__ == "__main__":
    main()
