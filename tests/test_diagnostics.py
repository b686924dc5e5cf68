"""Attention diagnostics: the statistics on hand-built maps, every variant's `attention_weights` against its
`attend`, recording in the model, the image, and the callback in a tiny fit read back from TensorBoard.

float64 throughout: exact comparisons, and threshold attention takes its PyTorch path on CPU.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lit_thresh.attention import (
    DifferentialAttention,
    DiffSoftmaxAttention,
    DiffThresholdAttention,
    RotaryEmbedding,
    SoftmaxAttention,
    ThresholdAttention,
)
from lit_thresh.cli import main
from lit_thresh.data import MQARDataModule, MQARSetting
from lit_thresh.diagnostics import (
    AttentionDiagnostics,
    attention_image,
    head_statistics,
    keys_attended,
    record_attention_maps,
    sink_mass,
    zero_fraction,
    zero_tile_fraction,
)
from lit_thresh.model import Transformer, TransformerConfig
from lit_thresh.module import LanguageModel

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_statistics_of_a_small_map():
    weights = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.5, 0.0, 0.5]], dtype=torch.float64)[None, None]
    assert zero_fraction(weights).tolist() == [1 / 6]  # one zero (query 2, key 1) among 6 causal weights
    assert sink_mass(weights).tolist() == [(0.25 + 0.5) / 2]  # queries 1 and 2
    assert keys_attended(weights).tolist() == [[1.0, 2.0, 2.0]]


def test_zero_tile_fraction_counts_the_all_zero_tiles_below_the_diagonal():
    """T = 256: 64 x 64 tiles (m, n) with n < m are wholly below the diagonal, 6 of them. Head 0 is dense;
    head 1 has tiles (2, 0), (3, 0), (3, 1) all zero, and (2, 1) zero but for one weight; its diagonal tiles
    and the zeros above the diagonal do not count. Threshold-like zeros scattered everywhere leave no tile."""
    t = 256
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    weights = (0.1 + torch.rand(1, 2, t, t, generator=generator(5), dtype=torch.float64)) * causal  # (1, 2, T, T)
    for m, n in ((2, 0), (3, 0), (3, 1), (2, 1)):
        weights[0, 1, m * 64:(m + 1) * 64, n * 64:(n + 1) * 64] = 0.0
    weights[0, 1, 150, 100] = 0.3  # tile (2, 1) keeps one weight
    weights[0, 1, 10:40, 0:5] = 0.0  # zeros inside a diagonal tile: not counted
    assert zero_tile_fraction(weights).tolist() == [0.0, 3 / 6]
    sparse = weights[:, :1] * (torch.rand(1, 1, t, t, generator=generator(6)) < 0.05)  # ~95% zeros, scattered
    assert zero_fraction(sparse).item() > 0.9 and zero_tile_fraction(sparse).tolist() == [0.0]


def test_zero_tile_fraction_of_decoding_maps_and_short_ones():
    """With Tq < Tk the tiles start at query 0 of the map (position Tk - Tq): Tq = 70 queries after 130 keys give
    query tiles at positions 130 and 194, which see key tiles 0 and 1 (keys 0-127) and 0-2 (keys 0-191): 5 of the
    2 x 4 tiles. With T <= 64 there is none (at T = 65 query 64 starts a tile past key tile 0), and
    head_statistics leaves the tag out."""
    weights = torch.ones(2, 1, 70, 200, dtype=torch.float64).tril(diagonal=130)  # (B, H, Tq, Tk), causal
    weights[1, 0, 0:64, 64:128] = 0.0  # sequence 1: query tile 0's key tile 1
    assert zero_tile_fraction(weights).tolist() == [1 / 10]  # 1 of the 2 sequences x 5 tiles
    short = torch.ones(1, 2, 64, 64, dtype=torch.float64).tril()
    assert zero_tile_fraction(short) is None and "zero_tile_frac" not in head_statistics(short)
    longer = torch.ones(1, 2, 65, 65, dtype=torch.float64).tril()
    assert zero_tile_fraction(longer).tolist() == [0.0, 0.0] and "zero_tile_frac" in head_statistics(longer)


def hand_built_map(b: int = 3, h: int = 2, t: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """A causal map with known sink shares and zeros: row i >= 1 puts share m on key 0 and 1 - m on a random
    nonempty subset of keys 1..i with random signs (as a differential map may); row `empty` is all zero.
    Returns (weights (B, H, T, T), m (B, H, T), nonzero (B, H, T, T), empty)."""
    g = generator(0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    later_keys = causal & (torch.arange(t) >= 1)  # (T, T): keys 1..i
    nonzero = later_keys & (torch.rand(b, h, t, t, generator=g) < 0.6)  # (B, H, T, T)
    nonzero |= torch.eye(t, dtype=torch.bool) & later_keys  # every row i >= 1 keeps its own key i
    m = 0.05 + 0.9 * torch.rand(b, h, t, generator=g, dtype=torch.float64)  # (B, H, T)
    rest = (0.1 + torch.rand(b, h, t, t, generator=g, dtype=torch.float64)) * nonzero  # (B, H, T, T)
    rest = rest / rest.sum(-1, keepdim=True).clamp_min(1e-300) * (1 - m[..., None])
    signs = torch.where(torch.rand(b, h, t, t, generator=g) < 0.3, -1.0, 1.0).to(torch.float64)
    weights = signs * rest
    weights[..., 0] = m  # position 0 (no later keys) puts all its mass there
    nonzero[..., 0] = True
    empty = (1, 1, 5)
    weights[empty] = 0.0
    nonzero[empty] = False
    return weights, m, nonzero, empty


def test_statistics_of_a_hand_built_map():
    weights, m, nonzero, empty = hand_built_map()
    b, _, t, _ = weights.shape
    expected_zeros = 1 - nonzero.sum(dim=(0, 2, 3)) / (b * t * (t + 1) / 2)  # (H,)
    torch.testing.assert_close(zero_fraction(weights), expected_zeros.double())

    counted = torch.ones_like(m, dtype=torch.bool)
    counted[:, :, 0] = False  # position 0 is left out
    counted[empty] = False  # a row without mass has no sink share
    expected_sink = (m * counted).sum(dim=(0, 2)) / counted.sum(dim=(0, 2))  # (H,)
    torch.testing.assert_close(sink_mass(weights), expected_sink)

    per_query = nonzero.sum(-1).double().mean(0)  # (H, T)
    torch.testing.assert_close(keys_attended(weights), per_query)

    stats = head_statistics(weights, position_bins=4)
    assert list(stats) == [
        "zero_frac", "sink_mass", "keys_attended",
        "keys_attended_pos00-02", "keys_attended_pos03-05", "keys_attended_pos06-08", "keys_attended_pos09-11",
    ]  # fmt: skip
    torch.testing.assert_close(stats["keys_attended"], per_query.mean(-1))
    torch.testing.assert_close(stats["keys_attended_pos06-08"], per_query[:, 6:9].mean(-1))


def test_statistics_of_softmax_and_decoding_maps():
    """Softmax: no zeros, every causal key attended; with Tq < Tk the queries are the last positions."""
    scores = torch.randn(2, 3, 10, 10, generator=generator(1), dtype=torch.float64)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, -math.inf).softmax(-1)  # (B, H, T, T)
    assert zero_fraction(weights).tolist() == [0.0] * 3
    torch.testing.assert_close(keys_attended(weights), torch.arange(1.0, 11.0, dtype=torch.float64).expand(3, 10))
    torch.testing.assert_close(sink_mass(weights), weights[:, :, 1:, 0].mean(dim=(0, 2)))

    last = weights[:, :, 6:]  # (B, H, 4, 10): the queries at positions 6..9
    stats = head_statistics(last, position_bins=2)
    assert set(stats) >= {"keys_attended_pos6-7", "keys_attended_pos8-9"}
    torch.testing.assert_close(stats["keys_attended_pos8-9"], torch.full((3,), 9.5, dtype=torch.float64))
    torch.testing.assert_close(sink_mass(last), weights[:, :, 6:, 0].mean(dim=(0, 2)))


VARIANTS = [
    (SoftmaxAttention, {}),
    (ThresholdAttention, {}),
    (ThresholdAttention, {"qk_norm": True, "out_norm": False, "power": 1.5, "beta": 0.3}),
    (DiffThresholdAttention, {}),
    (DiffThresholdAttention, {"qk_norm": False, "beta": 0.5, "scale": 0.5}),
    (DiffSoftmaxAttention, {"scale": 0.7}),
]
IDS = [f"{cls.__name__}-{'-'.join(kwargs) or 'default'}" for cls, kwargs in VARIANTS]


def make(cls, kwargs, d_model: int = 32, n_heads: int = 4, n_kv_heads: int = 2):
    torch.manual_seed(0)
    attn = cls(d_model, n_heads, 1, n_kv_heads=n_kv_heads, **kwargs).double()
    for p in attn.parameters():  # bigger than the model's init, so that every head attends somewhere
        nn.init.normal_(p, std=0.3)
    return attn


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=IDS)
@pytest.mark.parametrize("tq", [9, 3], ids=["prefill", "decode"])
def test_attention_weights_reproduce_attend(cls, kwargs, tq):
    attn, g = make(cls, kwargs), generator(2)
    groups, tk = attn.qk_groups, 9
    q = torch.randn(2, groups * 4, tq, attn.qk_head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, groups * 2, tk, attn.qk_head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, tk, attn.head_dim, generator=g, dtype=torch.float64)
    weights = attn.attention_weights(q, k)  # (B, H, Tq, Tk)
    assert weights.shape == (2, 4, tq, tk) and weights.dtype == torch.float64
    future = ~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    assert (weights[..., future] == 0).all()
    mixed = weights @ v.repeat_interleave(2, dim=1)  # (B, H, Tq, Dh)
    if isinstance(attn, DifferentialAttention):
        expected = attn.out_norm(mixed) * (1 - attn.lambda_init)
        assert (weights < 0).any()  # A1 - lambda A2
    else:
        expected = getattr(attn, "out_norm", nn.Identity())(mixed)
    torch.testing.assert_close(attn.attend(q, k, v), expected, rtol=1e-10, atol=1e-12)
    if isinstance(attn, ThresholdAttention):
        assert (weights >= 0).all() and (weights == 0).any() and (weights > 0).any()
    if cls is SoftmaxAttention:
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, tq, dtype=torch.float64))


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=IDS)
def test_diagnostic_values(cls, kwargs):
    attn = make(cls, kwargs)
    values = attn.diagnostic_values()
    expected = ({"beta"} if "Threshold" in cls.__name__ else set()) | ({"lambda"} if "Diff" in cls.__name__ else set())
    assert set(values) == expected
    if "beta" in values:
        assert values["beta"] is attn.threshold.beta and values["beta"].shape == (4,)
    if "lambda" in values:
        assert values["lambda"].shape == () and values["lambda"].item() == attn.lambda_full().item()


@pytest.mark.parametrize("cls,kwargs", VARIANTS[::2], ids=IDS[::2])
def test_record_attention_maps(cls, kwargs):
    torch.manual_seed(0)
    config = TransformerConfig(37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=cls, key_conv=2)
    model = Transformer(config).double()
    idx = torch.randint(0, 37, (3, 11), generator=generator(3))
    model.train()
    maps = record_attention_maps(model, idx)
    assert [layer for layer, _ in maps] == [block.attn for block in model.blocks]
    for layer, weights in maps:
        assert weights.shape == (3, 4, 11, 11) and not weights.requires_grad
        assert not layer.record_weights and layer.last_weights is None  # switched off again
        future = ~torch.ones(11, 11, dtype=torch.bool).tril()
        assert (weights[..., future] == 0).all() and (weights != 0).any()
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        model(idx)
    assert all(block.attn.last_weights is None for block in model.blocks)  # nothing stored when not recording
    with pytest.raises(ValueError, match="no lit_thresh.attention.Attention layer"):
        record_attention_maps(nn.Linear(3, 3), torch.randn(2, 3))


def test_recording_matches_attention_weights_on_the_layer_input():
    attn, rope = make(ThresholdAttention, {}), RotaryEmbedding()
    x = torch.randn(2, 7, 32, generator=generator(4), dtype=torch.float64)
    plain = attn(x, rope)
    attn.record_weights = True
    recorded = attn(x, rope)
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)
    b, t = x.shape[:2]
    q = rope(attn.q_proj(x).view(b, t, 4, 8).transpose(1, 2))  # (B, H, T, Dh)
    k = rope(attn.k_proj(x).view(b, t, 2, 8).transpose(1, 2))  # (B, Hkv, T, Dh)
    torch.testing.assert_close(attn.last_weights, attn.attention_weights(q, k))


def test_attention_image():
    weights = torch.randn(3, 5, 5, generator=generator(5), dtype=torch.float64).tril()  # (H, T, T), signed
    image = attention_image(weights, min_height=12)  # s = 3
    assert image.shape == (3, 15, 3 * (3 * 6 - 1)) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1
    scaled = weights / weights.abs().amax(-1, keepdim=True)
    for head, i, j in [(0, 0, 0), (1, 4, 2), (2, 3, 1), (2, 1, 4)]:
        pixel = image[:, 3 * i + 1, 3 * (head * 6 + j) + 2]  # inside the 3x3 block of weight (i, j)
        w = scaled[head, i, j].item()
        expected = [w, w, w] if w >= 0 else [-w, 0.0, 0.0]
        torch.testing.assert_close(pixel, torch.tensor(expected, dtype=torch.float32))
    assert image[:, :, 3 * 5 : 3 * 6].eq(torch.tensor([0.0, 0.0, 0.6])[:, None, None]).all()  # separator


def test_callback_arguments():
    with pytest.raises(ValueError, match="num_sequences must be >= 1"):
        AttentionDiagnostics(num_sequences=0)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        AttentionDiagnostics(enabled="no")
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
        AttentionDiagnostics(max_seq_len=0)
    with pytest.raises(TypeError, match="position_bins must be an int"):
        AttentionDiagnostics(position_bins=2.5)


def test_cli_flag(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--data", "lit_thresh.data.MQARDataModule", "--diagnostics.enabled", "false",
              "--diagnostics.num_sequences", "2", "--print_config"])  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)["diagnostics"]
    assert config == {"enabled": False, "num_sequences": 2, "max_seq_len": 256, "position_bins": 4}


def fit(tmp_path, attention, callback: AttentionDiagnostics) -> tuple[LanguageModel, EventAccumulator]:
    """A 2-step fit (validation after each step) of a 2-layer, 2-head model on 16-token MQAR, in float64."""
    data = MQARDataModule(
        vocab_size=32,
        train=[MQARSetting(16, 2, 16)],
        val=[MQARSetting(16, 2, 8)],
        test_length_multipliers=[],
        batch_size=8,
    )
    torch.manual_seed(0)
    config = TransformerConfig(32, d_model=32, n_layers=2, n_heads=2, attention=attention, mlp_ratio=0, max_seq_len=16)
    model = LanguageModel(config)
    logger = TensorBoardLogger(tmp_path, name="run", default_hp_metric=False)
    trainer = L.Trainer(
        accelerator="cpu",
        precision="64-true",
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    return model, events


@pytest.mark.parametrize("attention", [DiffThresholdAttention, SoftmaxAttention])
def test_callback_logs_every_layer_and_head(tmp_path, attention):
    callback = AttentionDiagnostics(num_sequences=3, position_bins=2)
    model, events = fit(tmp_path, attention, callback)
    assert callback.input_ids.shape == (3, 16)
    diag = {tag for tag in events.Tags()["scalars"] if tag.startswith("diag/")}
    names = ["zero_frac", "sink_mass", "keys_attended", "keys_attended_pos00-07", "keys_attended_pos08-15"]
    if attention is DiffThresholdAttention:
        names.append("beta")
    expected = {f"diag/layer{layer}/head{head}/{name}" for layer in range(2) for head in range(2) for name in names}
    if attention is DiffThresholdAttention:
        expected |= {"diag/layer0/lambda", "diag/layer1/lambda"}
    assert diag == expected
    assert all([e.step for e in events.Scalars(tag)] == [1, 2] for tag in diag)  # not at the sanity check
    assert events.Tags()["images"] == ["diag/layer0/attention", "diag/layer1/attention"]
    image = events.Images("diag/layer1/attention")[-1]
    assert (image.height, image.width, image.step) == (128, 8 * (2 * 17 - 1), 2)

    def last(tag: str) -> float:
        return events.Scalars(tag)[-1].value

    maps = record_attention_maps(model, callback.input_ids)  # the final model on the fixed batch
    for layer, (attn, weights) in enumerate(maps):
        for name, per_head in head_statistics(weights, 2).items():
            logged = [last(f"diag/layer{layer}/head{head}/{name}") for head in range(2)]
            assert logged == pytest.approx(per_head.tolist(), rel=1e-6, nan_ok=True)  # NaN: no mass
        if attention is DiffThresholdAttention:
            beta = [last(f"diag/layer{layer}/head{head}/beta") for head in range(2)]
            assert beta == pytest.approx(attn.threshold.beta.tolist(), rel=1e-6)
            assert last(f"diag/layer{layer}/lambda") == pytest.approx(attn.lambda_full().item(), rel=1e-6)
        else:  # softmax: no zeros, every causal key attended
            assert last(f"diag/layer{layer}/head0/zero_frac") == 0.0
            assert last(f"diag/layer{layer}/head1/keys_attended_pos08-15") == 12.5


def test_callback_disabled(tmp_path):
    callback = AttentionDiagnostics(enabled=False)
    _, events = fit(tmp_path, ThresholdAttention, callback)
    assert "val/loss" in events.Tags()["scalars"]
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("diag/")] and not events.Tags()["images"]
    assert callback.input_ids is None
