"""Every attention variant: shapes, causality, gradients, parameter parity, KV cache, argument checks.

float64 throughout: exact comparisons, and threshold attention takes its PyTorch path on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_thresh.attention import (
    Attention,
    DiffSoftmaxAttention,
    DiffThresholdAttention,
    KVCache,
    RotaryEmbedding,
    SoftmaxAttention,
    ThresholdAttention,
)
from lit_thresh.ops import threshold_attention_reference

VARIANTS = [SoftmaxAttention, ThresholdAttention, DiffThresholdAttention, DiffSoftmaxAttention]
# (variant, kwargs): the defaults plus the threshold options that change the computation.
CONFIGS = [(cls, {}) for cls in VARIANTS] + [
    (ThresholdAttention, {"qk_norm": True, "out_norm": False, "learn_beta": False, "power": 1.0}),
    (DiffThresholdAttention, {"qk_norm": False, "beta": 0.5, "scale": 0.5}),
    (ThresholdAttention, {"qk_norm": True, "learn_scale": True, "scale": 4.0, "power": 1.0}),
    (DiffThresholdAttention, {"learn_scale": True, "scale": 2.0}),
]
IDS = [f"{cls.__name__}-{'-'.join(kwargs) or 'default'}" for cls, kwargs in CONFIGS]


def make(cls, kwargs=None, d_model=32, n_heads=4, n_kv_heads=2, layer_index=1) -> Attention:
    torch.manual_seed(0)
    attn = cls(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, **(kwargs or {})).double()
    for p in attn.parameters():  # bigger than the model's init, so that every head attends somewhere
        torch.nn.init.normal_(p, std=0.3)
    return attn


def inputs(b=2, t=9, c=32) -> torch.Tensor:
    return torch.randn(b, t, c, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=IDS)
@pytest.mark.parametrize("rope", [None, RotaryEmbedding()], ids=["no-rope", "rope"])
def test_output_shape_and_causality(cls, kwargs, rope):
    attn, x = make(cls, kwargs), inputs()
    out = attn(x, rope)  # (B, T, C)
    assert out.shape == x.shape and out.dtype == x.dtype
    changed = x.clone()
    changed[:, 5] += 1.0
    out2 = attn(changed, rope)
    torch.testing.assert_close(out2[:, :5], out[:, :5], rtol=0, atol=1e-12)
    assert not torch.allclose(out2[:, 5:], out[:, 5:])


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=IDS)
def test_gradients_reach_every_parameter(cls, kwargs):
    attn = make(cls, kwargs)
    attn(inputs(), RotaryEmbedding()).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=IDS)
@pytest.mark.parametrize("rope", [None, RotaryEmbedding()], ids=["no-rope", "rope"])
def test_kv_cache_decoding_matches_full_forward(cls, kwargs, rope):
    attn, x = make(cls, kwargs), inputs()
    full = attn(x, rope)  # (B, T, C)
    cache = KVCache()
    chunks = [attn(x[:, a:b], rope, cache) for a, b in [(0, 3), (3, 6), (6, 7), (7, 8), (8, 9)]]
    assert cache.length == x.shape[1]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("d_model,n_heads,n_kv_heads", [(128, 1, 1), (384, 6, 6), (384, 6, 2), (256, 4, 1)])
def test_parameter_counts_match_softmax_within_one_percent(d_model, n_heads, n_kv_heads):
    def count(cls):
        return sum(p.numel() for p in cls(d_model, n_heads, n_kv_heads=n_kv_heads).parameters())

    softmax = count(SoftmaxAttention)
    for cls in VARIANTS:
        assert abs(count(cls) - softmax) <= 0.01 * softmax, cls.__name__


def test_threshold_attention_is_the_normalised_threshold_map():
    attn = make(ThresholdAttention, {"qk_norm": True, "power": 1.5, "scale": 2.0}, n_kv_heads=4)
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    expected = threshold_attention_reference(
        F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, attn.threshold.beta, 1.5, 2.0
    )
    torch.testing.assert_close(attn.attend(q, k, v), attn.out_norm(expected))


def test_fixed_beta_is_a_buffer():
    attn = ThresholdAttention(32, 4, beta=0.7, learn_beta=False)
    assert "threshold.beta" not in dict(attn.named_parameters())
    torch.testing.assert_close(attn.state_dict()["threshold.beta"], torch.full((4,), 0.7))
    assert ThresholdAttention(32, 4).threshold.beta.requires_grad


@pytest.mark.parametrize("layer_index", [0, 1, 5])
def test_differential_lambda(layer_index):
    attn = DiffSoftmaxAttention(32, 4, layer_index)
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * layer_index))
    with torch.no_grad():
        for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2):
            p.fill_(0.5)  # both exponentials equal: lambda = lambda_init
    assert attn.lambda_full().item() == pytest.approx(attn.lambda_init)


def test_diff_threshold_combines_two_maps_with_unclamped_lambda():
    attn = make(DiffThresholdAttention, {"beta": 0.3}, n_kv_heads=4)
    with torch.no_grad():
        attn.lambda_q1.fill_(0.5), attn.lambda_k1.fill_(0.5), attn.lambda_q2.zero_()  # lambda > 1
    lam = attn.lambda_full()
    assert lam > 1
    q, k = torch.randn(2, 8, 6, 4, dtype=torch.float64), torch.randn(2, 8, 6, 4, dtype=torch.float64)
    v = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    (q1, q2), (k1, k2) = (F.normalize(t, dim=-1).chunk(2, dim=1) for t in (q, k))
    beta = attn.threshold.beta
    y = threshold_attention_reference(q1, k1, v, beta) - lam * threshold_attention_reference(q2, k2, v, beta)
    torch.testing.assert_close(attn.attend(q, k, v), attn.out_norm(y) * (1 - attn.lambda_init))


def test_diff_softmax_matches_explicit_maps():
    attn = make(DiffSoftmaxAttention, n_kv_heads=4)
    q, k = torch.randn(2, 8, 6, 4, dtype=torch.float64), torch.randn(2, 8, 6, 4, dtype=torch.float64)
    v = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    maps = (q @ k.transpose(-1, -2) / 2.0).masked_fill(future, -math.inf).softmax(-1)  # (B, 2H, T, T), 1/sqrt(4)
    a1, a2 = maps.chunk(2, dim=1)
    y = a1 @ v - attn.lambda_full() * (a2 @ v)
    torch.testing.assert_close(attn.attend(q, k, v), attn.out_norm(y) * (1 - attn.lambda_init))


@pytest.mark.parametrize("cls", VARIANTS)
@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((30, 4), {}, ValueError, "d_model"),
        ((0, 1), {}, ValueError, "d_model"),
        ((32, 0), {}, ValueError, "n_heads"),
        ((32, 2.0), {}, TypeError, "n_heads"),
        ((32, 4), {"n_kv_heads": 3}, ValueError, "n_kv_heads"),
        ((32, 4, -1), {}, ValueError, "layer_index"),
    ],
)
def test_bad_shape_arguments_are_named(cls, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(*args, **kwargs)


@pytest.mark.parametrize("cls", [DiffThresholdAttention, DiffSoftmaxAttention])
def test_differential_needs_an_even_head_dim(cls):
    with pytest.raises(ValueError, match="head dim"):
        cls(6, 2)


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"power": 0.0}, ValueError, "power"),
        ({"beta": math.nan}, ValueError, "beta"),
        ({"beta": "1"}, TypeError, "beta"),
        ({"scale": -1.0}, ValueError, "scale"),
    ],
)
def test_bad_threshold_arguments_are_named(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(32, 4, **kwargs)


@pytest.mark.parametrize("cls", [SoftmaxAttention, DiffSoftmaxAttention])
def test_bad_softmax_scale_is_named(cls):
    with pytest.raises(ValueError, match="scale"):
        cls(32, 4, scale=0.0)


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=IDS)
def test_runs_under_bfloat16_autocast(cls, kwargs):
    attn = make(cls, kwargs).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(inputs().float(), RotaryEmbedding())
    assert out.shape == (2, 9, 32) and out.dtype == torch.bfloat16 and out.isfinite().all()


@pytest.mark.parametrize("cls", VARIANTS)
def test_every_variant_passes_key_conv_on(cls):
    """The plug-in contract: a variant hands the factory's key_conv to Attention, which builds the conv."""
    attn = make(cls, {"key_conv": 2})
    assert attn.key_conv is not None and attn.key_conv.weight.shape == (2 * 8, 2)  # (Hkv * Dh, width)
