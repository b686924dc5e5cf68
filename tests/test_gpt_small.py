"""The GPT-small configs (configs/text/shakespeare_bpe_gpt_small_*.yaml) hold the parameters their comments
state, with the vocabulary their BPE learns from tiny-shakespeare and their block size. (That each config
trains on CPU is tests/test_configs.py's business: it picks up every YAML.)"""

import dataclasses
import re

import pytest
import yaml

from lit_thresh.cli import build_cli
from lit_thresh.model import Transformer
from tests.test_configs import CONFIGS, TINY_TRAINER, offline_cpu, tiny_data  # noqa: F401 (offline_cpu: a fixture)

GPT_SMALL = sorted((CONFIGS / "text").glob("shakespeare_bpe_gpt_small_*.yaml"))
STATED = re.compile(r"^# ([\d,]+) parameters \(model\.n_params\)", re.MULTILINE)


def test_there_are_softmax_and_threshold_configs():
    assert [path.stem.rsplit("_", 1)[1] for path in GPT_SMALL] == ["softmax", "threshold"]


@pytest.mark.parametrize("path", GPT_SMALL, ids=lambda p: p.stem)
def test_the_comment_states_the_parameter_count(path, offline_cpu):  # noqa: F811 (the fixture)
    """Built by the CLI on a tiny text (a small vocabulary), then at the config's own vocabulary (the BPE's
    target: tiny-shakespeare fills all 8192) and block size."""
    (stated,) = STATED.findall(path.read_text())
    data = yaml.safe_load(path.read_text())["data"]["init_args"]
    vocab_size, block_size = data["tokenizer"]["init_args"]["vocab_size"], data["block_size"]
    cli = build_cli(["--config", str(path), *TINY_TRAINER, *tiny_data(path, offline_cpu)], run=False)
    config = cli.model.model.config
    assert (config.n_layers, config.n_heads, config.d_model, config.mlp_ratio) == (12, 12, 768, 4)  # GPT-2 small
    full = Transformer(dataclasses.replace(config, vocab_size=vocab_size, max_seq_len=block_size))
    assert sum(p.numel() for p in full.parameters()) == int(stated.replace(",", ""))
