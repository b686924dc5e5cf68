"""Differential softmax attention: the Differential Transformer baseline."""

from __future__ import annotations

import torch

from lit_thresh.attention.differential import DifferentialAttention
from lit_thresh.attention.softmax import causal_sdpa, causal_softmax_weights
from lit_thresh.validation import check_finite_float


class DiffSoftmaxAttention(DifferentialAttention):
    """(softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V, see DifferentialAttention.

    scale: score scale, default 1/sqrt(Dh / 2).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        layer_index: int = 0,
        *,
        n_kv_heads: int | None = None,
        key_conv: int = 0,
        scale: float | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        if scale is not None:
            check_finite_float("scale", scale, positive=True)
        self.scale = scale

    def attend_map(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_sdpa(q, k, v, self.scale)  # (B, H, Tq, Dh)

    def map_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return causal_softmax_weights(q, k, self.scale)  # (B, H, Tq, Tk)
