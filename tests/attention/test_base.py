"""The shared pieces: rotary embedding, KV cache, key convolution, and softmax's bottom-right causal mask."""

from __future__ import annotations

import math

import pytest
import torch

from lit_thresh.attention import KeyConv, KVCache, RotaryEmbedding, SoftmaxAttention
from lit_thresh.attention.softmax import causal_sdpa


def test_rope_preserves_norms_and_encodes_relative_positions():
    rope = RotaryEmbedding()
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    torch.testing.assert_close(rope(q, start=7).norm(), q.norm())
    scores = [(rope(q, start=m) * rope(k, start=m - 3)).sum() for m in (3, 10, 50)]
    torch.testing.assert_close(torch.stack(scores), scores[0].expand(3))


def test_rope_start_offsets_positions():
    rope, x = RotaryEmbedding(), torch.randn(2, 3, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(rope(x[:, :, 4:], start=4), rope(x)[:, :, 4:])
    torch.testing.assert_close(rope(x[:, :, :1]), x[:, :, :1])  # position 0: no rotation


def test_rope_rejects_bad_theta():
    with pytest.raises(ValueError, match="theta"):
        RotaryEmbedding(theta=0.0)


def test_kv_cache_appends_along_time():
    cache = KVCache()
    assert cache.length == 0
    k, v = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))
    assert cache.length == 3 and (k.shape, v.shape) == ((1, 2, 3, 4), (1, 2, 3, 5))
    k, v = cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 5))
    assert cache.length == 4 and k[:, :, -1].eq(1).all() and v[:, :, :3].eq(0).all()


@pytest.mark.parametrize("tq", [1, 3, 6])
@pytest.mark.parametrize("hkv", [1, 4])
def test_causal_sdpa_aligns_queries_to_the_last_positions(tq, hkv):
    q = torch.randn(2, 4, tq, 8, dtype=torch.float64)
    k, v = torch.randn(2, hkv, 6, 8, dtype=torch.float64), torch.randn(2, hkv, 6, 5, dtype=torch.float64)
    k_rep, v_rep = k.repeat_interleave(4 // hkv, dim=1), v.repeat_interleave(4 // hkv, dim=1)
    pos = torch.arange(6 - tq, 6)[:, None]  # (Tq, 1) absolute positions of the queries
    future = torch.arange(6)[None, :] > pos  # (Tq, Tk)
    expected = ((q @ k_rep.transpose(-1, -2)) / math.sqrt(8)).masked_fill(future, -math.inf).softmax(-1) @ v_rep
    torch.testing.assert_close(causal_sdpa(q, k, v), expected)


def test_attention_builds_its_key_conv():
    attn = SoftmaxAttention(32, 4, n_kv_heads=2, key_conv=3)
    assert isinstance(attn.key_conv, KeyConv) and attn.key_conv.weight.shape == (16, 3)  # (Hkv * Dh, width)
    assert SoftmaxAttention(32, 4).key_conv is None
    for width, error in [(1, ValueError), (-1, ValueError), (2.0, TypeError)]:
        with pytest.raises(error, match="key_conv"):
            SoftmaxAttention(32, 4, key_conv=width)
