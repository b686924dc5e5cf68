"""Softmax attention: torch's scaled_dot_product_attention, causal."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_thresh.attention.base import Attention, causal_mask
from lit_thresh.validation import check_finite_float


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """softmax(scale q k^T) v, causal with the queries as the last Tq of the Tk positions.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv); scale None = 1/sqrt(D);
    dropout: probability of dropping each attention weight (training only; 0 = none).
    """
    tq, tk = q.shape[2], k.shape[2]
    # Tq == Tk: SDPA's own causal mask; Tq == 1: the last position sees every key; else bottom-right aligned.
    mask = None if tq in (1, tk) else causal_mask(tq, tk, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=tq == tk, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def causal_softmax_weights(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The probabilities causal_sdpa applies to v, in at least float32: q (B, Hq, Tq, D), k (B, Hkv, Tk, D)
    -> (B, Hq, Tq, Tk), exactly 0 on future keys."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    tq, d, tk = q.shape[2], q.shape[3], k.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, Hq, Tk, D)
    scale = d**-0.5 if scale is None else scale
    scores = scale * (q.to(dtype) @ k.to(dtype).transpose(-1, -2))  # (B, Hq, Tq, Tk)
    return scores.masked_fill(~causal_mask(tq, tk, q.device), float("-inf")).softmax(dim=-1)


class SoftmaxAttention(Attention):
    """Standard causal softmax attention. scale: score scale, default 1/sqrt(head dim); dropout: dropout
    on the attention weights while training (nanoGPT's attn_dropout; the threshold kernels have none)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        layer_index: int = 0,
        *,
        n_kv_heads: int | None = None,
        key_conv: int = 0,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        if scale is not None:
            check_finite_float("scale", scale, positive=True)
        check_finite_float("dropout", dropout)
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.scale, self.dropout = scale, float(dropout)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_sdpa(q, k, v, self.scale, self.dropout if self.training else 0.0)  # (B, H, Tq, Dh)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return causal_softmax_weights(q, k, self.scale)  # (B, H, Tq, Tk)
