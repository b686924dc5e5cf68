"""Softmax attention: torch's scaled_dot_product_attention, causal."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_thresh.attention.base import Attention, check_finite_float


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(scale q k^T) v, causal with the queries as the last Tq of the Tk positions.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv); scale None = 1/sqrt(D).
    """
    tq, tk = q.shape[2], k.shape[2]
    # Tq == Tk: SDPA's own causal mask; Tq == 1: the last position sees every key; else bottom-right aligned.
    mask = None if tq in (1, tk) else torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=tq == tk, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


class SoftmaxAttention(Attention):
    """Standard causal softmax attention. scale: score scale, default 1/sqrt(head dim)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        layer_index: int = 0,
        *,
        n_kv_heads: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads)
        if scale is not None:
            check_finite_float("scale", scale, positive=True)
        self.scale = scale

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_sdpa(q, k, v, self.scale)  # (B, H, Tq, Dh)
