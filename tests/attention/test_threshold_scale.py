"""The threshold variants' learned per-head score scale (learn_scale): gradients, the algebra that ties
it to beta under the output RMSNorm, its diagnostics, the state dict of the default, and its YAML.

float64 throughout: threshold attention takes its PyTorch path on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_thresh.attention import DiffThresholdAttention, RotaryEmbedding, ThresholdAttention
from lit_thresh.cli import build_cli
from lit_thresh.ops import threshold_attention_reference
from tests.attention.test_variants import inputs, make
from tests.test_configs import TINY_TRAINER
from tests.test_cli import QUICKSTART

LOG_GAINS = [0.0, math.log(3.0), math.log(0.5), math.log(8.0)]  # a different g per head (H = 4)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def qkv(heads: int = 4, dq: int = 8, dv: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(5)
    return tuple(torch.randn(2, h, 12, d, dtype=torch.float64, generator=rng) for h, d in
                 ((heads, dq), (heads, dq), (heads // 2 if dv == 2 * dq else heads, dv)))


def with_gains(attn, beta: float | torch.Tensor | None = None):
    """attn with g = exp(LOG_GAINS) per head and, if given, beta (make() draws every parameter at random)."""
    with torch.no_grad():
        if attn.threshold.log_scale is not None:
            attn.threshold.log_scale.copy_(torch.tensor(LOG_GAINS, dtype=torch.float64))
        if beta is not None:
            attn.threshold.beta.copy_(torch.as_tensor(beta, dtype=torch.float64))
    return attn


def pair(cls, kwargs: dict, beta: float):
    """(with g, without g): the same weights, beta in the first, beta / g in the second."""
    scaled = with_gains(make(cls, kwargs | {"learn_scale": True}, n_kv_heads=4), beta)
    plain = cls(32, 4, 1, n_kv_heads=4, **kwargs).double()
    plain.load_state_dict({k: v for k, v in scaled.state_dict().items() if k != "threshold.log_scale"})
    gain = torch.tensor(LOG_GAINS, dtype=torch.float64).exp()  # (H,)
    return scaled, with_gains(plain, beta / gain), gain


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
def test_gradients_reach_the_score_scale(cls):
    attn = make(cls, {"qk_norm": True, "learn_scale": True, "scale": 2.0})
    attn(inputs(), RotaryEmbedding()).square().sum().backward()
    grad = attn.threshold.log_scale.grad
    assert grad is not None and grad.shape == (4,) and (grad != 0).all()


def test_the_scale_multiplies_q_before_the_op():
    attn = with_gains(make(ThresholdAttention, {"qk_norm": True, "learn_scale": True, "power": 1.5}, n_kv_heads=4), 0.6)
    q, k, v = qkv()
    g = torch.tensor(LOG_GAINS, dtype=torch.float64).exp()[:, None, None]  # (H, 1, 1)
    expected = threshold_attention_reference(F.normalize(q, dim=-1) * g, F.normalize(k, dim=-1), v,
                                             attn.threshold.beta, 1.5, 1.0)
    assert rel_err(attn.threshold(q, k, v), expected) < 1e-12
    assert attn.threshold.scale == 1.0  # the op's float: the learned g went into q


@pytest.mark.parametrize("power", [1.0, 2.0])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_map_is_g_to_the_p_times_the_map_of_threshold_beta_over_g(power, qk_norm):
    """ReLU(g s - beta gamma)^p = g^p ReLU(s - (beta / g) gamma)^p, per head."""
    kwargs = {"qk_norm": qk_norm, "power": power, "beta": 0.7, "out_norm": False}
    scaled, plain, g = pair(ThresholdAttention, kwargs, 0.7)
    q, k, v = qkv()
    out, reference = scaled.attend(q, k, v), plain.attend(q, k, v) * g[:, None, None] ** power
    assert reference.abs().sum() > 0 and (reference == 0).any()  # some keys pass, some do not
    assert rel_err(out, reference) < 1e-12
    weights = scaled.attention_weights(q, k)  # the diagnostics' map, the same
    assert rel_err(weights, plain.attention_weights(q, k) * g[:, None, None] ** power) < 1e-12


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
def test_with_the_output_norm_only_beta_over_g_matters(cls):
    """The RMSNorm removes g^p: (beta, g) and (beta / g, 1) give one output but for the norm's eps,
    which weighs on the rows whose map output is small: RMSNorm(c y) = c y / sqrt(c^2 ms(y) + eps)."""
    scaled, plain, _ = pair(cls, {"qk_norm": True, "beta": 0.5, "power": 2.0}, 0.5)
    g = cls.qk_groups
    q, k = torch.randn(2, 2, g * 4, 9, 8 // g, dtype=torch.float64).unbind(0)  # (B, G*H, T, Dq) each, Dh = 8
    v = torch.randn(2, 4, 9, 8, dtype=torch.float64)  # (B, H, T, Dh)
    other = with_gains(pair(cls, {"qk_norm": True, "beta": 0.5, "power": 2.0}, 0.5)[1], 0.5)  # (beta, 1)
    assert rel_err(other.attend(q, k, v), plain.attend(q, k, v)) > 1e-2  # another threshold, another output
    for module in (scaled, plain):
        module.out_norm.eps = 0.0  # exact: rows without any key are 0 / 0 = NaN in both
    out, expected = scaled.attend(q, k, v), plain.attend(q, k, v)
    assert expected.isfinite().sum() > expected.numel() // 2
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12, equal_nan=True)
    for module in (scaled, plain):
        module.out_norm.eps = 1e-5  # the model's
    out, expected = scaled.attend(q, k, v), plain.attend(q, k, v)  # (B, H, T, Dh)
    if cls is ThresholdAttention:  # rows whose map output has a mean square >= 1e-2: eps changes < 1e-3
        large = plain.threshold(q, k, v).square().mean(dim=-1) >= 1e-2  # (B, H, T)
        assert large.sum() > 10 and rel_err(out[large], expected[large]) < 1e-3
    assert rel_err(out, expected) < 0.2


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
def test_the_scale_is_a_diagnostic_value_per_head_when_learned(cls):
    attn = with_gains(make(cls, {"learn_scale": True}))
    values = attn.diagnostic_values()
    torch.testing.assert_close(values["scale"], torch.tensor(LOG_GAINS, dtype=torch.float64).exp())
    assert values["beta"].shape == (4,)
    assert "scale" not in make(cls).diagnostic_values()


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
def test_default_state_dict_is_unchanged_and_the_scale_initialises_at_scale(cls):
    default = cls(32, 4)
    assert not any("scale" in key for key in default.state_dict())  # checkpoints of before load as they were
    cls(32, 4).load_state_dict(default.state_dict(), strict=True)
    learned = cls(32, 4, learn_scale=True, scale=10.0)
    assert set(learned.state_dict()) == set(default.state_dict()) | {"threshold.log_scale"}
    torch.testing.assert_close(learned.threshold.gain(), torch.full((4,), 10.0))
    assert "scale=learned" in repr(learned.threshold)


@pytest.mark.parametrize("cls", [ThresholdAttention, DiffThresholdAttention])
def test_bad_learn_scale_is_named(cls):
    with pytest.raises(TypeError, match="learn_scale must be a bool"):
        cls(32, 4, learn_scale="yes")


@pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")
def test_yaml_init_args_build_the_learned_scale_without_weight_decay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    piece = tmp_path / "scale.yaml"
    piece.write_text("model:\n  config:\n    attention:\n      class_path: lit_thresh.attention.ThresholdAttention\n"
                     "      init_args: {qk_norm: true, learn_scale: true, scale: 4.0, beta: 2.0}\n")
    cli = build_cli(["--config", str(QUICKSTART), "--config", str(piece), *TINY_TRAINER], run=False)
    layers = [m for m in cli.model.modules() if isinstance(m, ThresholdAttention)]
    assert len(layers) == 2
    for layer in layers:
        torch.testing.assert_close(layer.threshold.gain(), torch.full((1,), 4.0))
        assert layer.threshold.qk_norm and layer.threshold.beta.item() == 2.0
    cli.model.trainer = cli.trainer  # configure_optimizers reads the training length
    groups = cli.model.configure_optimizers()["optimizer"].param_groups
    no_decay = [id(p) for group in groups if group["weight_decay"] == 0.0 for p in group["params"]]
    assert all(id(layer.threshold.log_scale) in no_decay for layer in layers)
