"""Attention variants. Each layer's module is built as `attention(d_model, n_heads, layer_index)`."""

from lit_thresh.attention.base import Attention, AttentionFactory, KeyConv, KVCache, RotaryEmbedding
from lit_thresh.attention.diff_softmax import DiffSoftmaxAttention
from lit_thresh.attention.diff_threshold import DiffThresholdAttention
from lit_thresh.attention.differential import DifferentialAttention
from lit_thresh.attention.softmax import SoftmaxAttention
from lit_thresh.attention.threshold import ThresholdAttention, ThresholdMap

__all__ = [
    "Attention",
    "AttentionFactory",
    "DiffSoftmaxAttention",
    "DiffThresholdAttention",
    "DifferentialAttention",
    "KeyConv",
    "KVCache",
    "RotaryEmbedding",
    "SoftmaxAttention",
    "ThresholdAttention",
    "ThresholdMap",
]
