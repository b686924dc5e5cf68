"""Differential threshold attention: A1 V - lambda A2 V with threshold rectified maps."""

from __future__ import annotations

import torch

from lit_thresh.attention.differential import DifferentialAttention
from lit_thresh.attention.threshold import ThresholdMap
from lit_thresh.ops.api import MAX_HEAD_DIM


class DiffThresholdAttention(DifferentialAttention):
    """Differential attention (see DifferentialAttention) over two threshold maps that share beta.

    Variant kwargs: see ThresholdMap; q and k are L2-normalised by default (qk_norm), as in the
    seed's differential kernel. lambda is unclamped, as in the Differential Transformer, so the two
    maps are two threshold_attention calls rather than differential_threshold_rela_triton (which
    clamps lambda to [0, 1]).
    """

    max_head_dim = MAX_HEAD_DIM  # the ops' limit, on v's head dim (q's and k's are half of it)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        layer_index: int = 0,
        *,
        n_kv_heads: int | None = None,
        beta: float = 1.0,
        learn_beta: bool = True,
        power: float = 2.0,
        qk_norm: bool = True,
        scale: float = 1.0,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads)
        self.threshold = ThresholdMap(
            n_heads, beta=beta, learn_beta=learn_beta, power=power, qk_norm=qk_norm, scale=scale
        )

    def attend_map(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.threshold(q, k, v)  # (B, H, Tq, Dh)

    def map_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.threshold.weights(q, k)  # (B, H, Tq, Tk)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        return {"beta": self.threshold.beta} | super().diagnostic_values()  # (H,), 0-d
