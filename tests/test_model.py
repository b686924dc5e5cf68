"""The decoder-only Transformer: shapes, causality, init, tied head, cached decoding, generation, checks.

float64 where outputs are compared: exact comparisons, and threshold attention takes its PyTorch path.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lit_thresh.attention import (
    DiffSoftmaxAttention,
    DiffThresholdAttention,
    KeyConv,
    SoftmaxAttention,
    ThresholdAttention,
)
from lit_thresh.model import Transformer, TransformerConfig

VARIANTS = [SoftmaxAttention, ThresholdAttention, DiffThresholdAttention, DiffSoftmaxAttention]
VOCAB = 11


def make(attention=SoftmaxAttention, **kwargs) -> Transformer:
    torch.manual_seed(0)
    config = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention, max_seq_len=16) | kwargs
    return Transformer(TransformerConfig(VOCAB, **config)).double()


def tokens(b=2, t=10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(1))


def random_key_convs(model: Transformer) -> Transformer:
    """Random conv taps (instead of the uniform init), so that every tap and the cache's tail matter."""
    for module in model.modules():
        if isinstance(module, KeyConv):
            torch.nn.init.normal_(module.weight)
    return model


@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize("positional,key_conv", [("rope", 0), ("learned", 0), ("none", 0), ("rope", 3)])
def test_logits_shape_and_causality(attention, positional, key_conv):
    model, idx = random_key_convs(make(attention, positional=positional, key_conv=key_conv)), tokens()
    logits = model(idx)
    assert logits.shape == (2, 10, VOCAB)
    changed = idx.clone()
    changed[:, 6] = (changed[:, 6] + 1) % VOCAB
    logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :6], logits[:, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(logits2[:, 6:], logits[:, 6:])


@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize(
    "positional,mlp_ratio,key_conv", [("rope", 4.0, 0), ("learned", 0.0, 0), ("none", 2.0, 0), ("rope", 0.0, 3)]
)
def test_cached_decoding_matches_full_forward(attention, positional, mlp_ratio, key_conv):
    model = random_key_convs(make(attention, positional=positional, mlp_ratio=mlp_ratio, key_conv=key_conv))
    model, idx = model.eval(), tokens()
    full = model(idx)  # (B, T, V)
    caches = model.new_caches()
    steps = [model(idx[:, :4], caches), model(idx[:, 4:6], caches)] + [
        model(idx[:, t : t + 1], caches) for t in range(6, 10)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("attention", VARIANTS)
def test_greedy_generation_matches_recomputing_the_full_sequence(attention):
    model, prompt = make(attention).eval(), tokens(t=3)
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert out.shape == (2, 8) and torch.equal(out[:, :3], prompt)
    for t in range(3, 8):
        torch.testing.assert_close(out[:, t], model(out[:, :t])[:, -1].argmax(-1), rtol=0, atol=0)


def test_sampling_respects_top_k():
    model, prompt = make().eval(), tokens(t=3)
    torch.testing.assert_close(model.generate(prompt, 4, top_k=1), model.generate(prompt, 4, temperature=0))
    out = model.generate(prompt, 6, temperature=2.0, top_k=3)
    assert out.shape == (2, 9) and out.min() >= 0 and out.max() < VOCAB


def test_no_mlp_blocks_and_tied_head():
    model = make(mlp_ratio=0)
    assert all(block.mlp is None for block in model.blocks)
    assert model.lm_head.weight is model.token_emb.weight
    expected = VOCAB * 32 + 2 * (4 * 32 * 32 - 2 * 32 * 16 + 32) + 32  # embedding, 2 x (GQA attention + norm), norm
    assert sum(p.numel() for p in model.parameters()) == expected


def test_gpt2_init():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(1000, d_model=256, n_layers=4, n_heads=4, mlp_ratio=4.0))
    residual_std = 0.02 / math.sqrt(2 * 4)
    assert model.token_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[3].mlp.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)


def test_attention_factory_gets_the_layer_index_kv_heads_and_key_conv():
    attention = functools.partial(ThresholdAttention, beta=0.5)
    config = TransformerConfig(VOCAB, 32, n_layers=3, n_heads=4, n_kv_heads=1, attention=attention, key_conv=3)
    model = Transformer(config)
    assert [block.attn.layer_index for block in model.blocks] == [0, 1, 2]
    assert all(block.attn.n_kv_heads == 1 for block in model.blocks)
    assert all(block.attn.key_conv.weight.shape == (8, 3) for block in model.blocks)  # (Hkv * Dh, width)
    assert model.blocks[2].attn.threshold.beta.eq(0.5).all()


def test_learned_positions_stop_at_max_seq_len():
    model = make(positional="learned")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(t=17))
    # generation slides its window instead (tests/test_generate.py checks the tokens it picks)
    assert model.generate(tokens(t=10), max_new_tokens=8).shape[1] == 18


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        ({"n_layers": 0}, ValueError, "n_layers"),
        ({"positional": "alibi"}, ValueError, "positional"),
        ({"mlp_ratio": -1.0}, ValueError, "mlp_ratio"),
        ({"mlp_ratio": float("nan")}, ValueError, "mlp_ratio"),
        ({"d_model": 32.0}, TypeError, "d_model"),
        ({"norm": "batchnorm"}, ValueError, "norm"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"key_conv": 1}, ValueError, "key_conv"),
        ({"key_conv": -2}, ValueError, "key_conv"),
        ({"d_model": 30}, ValueError, "d_model"),
        ({"attention": lambda *args, **kwargs: torch.nn.Identity()}, TypeError, "attention"),
        ({"d_model": 24, "n_heads": 4, "attention": DiffSoftmaxAttention}, ValueError, "rope"),  # q/k head dim 3
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    config = dict(vocab_size=VOCAB, d_model=32, n_heads=4) | kwargs
    with pytest.raises(error, match=match):
        Transformer(TransformerConfig(**config))


def test_transformer_takes_a_config_only():
    with pytest.raises(TypeError, match="config must be a TransformerConfig, got dict"):
        Transformer({"vocab_size": VOCAB})


@pytest.mark.parametrize(
    "kwargs,match",
    [({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k")],
)
def test_bad_generation_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make().generate(tokens(), **({"max_new_tokens": 2} | kwargs))
