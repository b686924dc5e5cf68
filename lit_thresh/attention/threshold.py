"""Threshold rectified attention: out_i = sum_{j <= i} ReLU(scale q_i.k_j - tau_i)^p v_j (lit_thresh.ops).

tau_i = beta_h * sqrt(2 ln(i + 1) / Dq) grows with the position i, so a query attends only to keys
that beat the noise level of i random scores. No softmax normalisation: the output of a head is a sum
of |{j: score > tau}| terms, hence the per-head RMSNorm on the output (`out_norm`, as in ReLA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_thresh.attention.base import Attention
from lit_thresh.ops import threshold_attention
from lit_thresh.ops.api import MAX_HEAD_DIM
from lit_thresh.ops.reference import threshold_attention_weights
from lit_thresh.validation import check_finite_float


class ThresholdMap(nn.Module):
    """The threshold attention map applied to v, with its per-head beta (shared by threshold variants).

    beta: initial threshold scale of every head; learn_beta: beta is an (H,) parameter, else a
    buffer; power: p > 0; qk_norm: L2-normalise q and k first, so that the scores are cosines
    (times `scale`); scale: score scale, 1 by default (no 1/sqrt(d)).
    """

    def __init__(
        self, n_heads: int, *, beta: float, learn_beta: bool, power: float, qk_norm: bool, scale: float
    ) -> None:
        super().__init__()
        check_finite_float("beta", beta)
        check_finite_float("power", power, positive=True)
        check_finite_float("scale", scale, positive=True)
        beta_h = torch.full((n_heads,), float(beta))  # (H,)
        if learn_beta:
            self.beta = nn.Parameter(beta_h)
        else:
            self.register_buffer("beta", beta_h)
        self.power, self.qk_norm, self.scale = float(power), qk_norm, float(scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv), causal."""
        if self.qk_norm:  # in q's dtype: autocast computes norms in float32
            q, k = F.normalize(q, dim=-1).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)
        return threshold_attention(q, k, v, self.beta, self.power, scale=self.scale)

    def weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The map `forward` applies to v, as `threshold_attention_reference` computes it, in at least
        float32: q (B, H, Tq, D), k (B, Hkv, Tk, D) -> (B, H, Tq, Tk), exactly 0 on future keys."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        q, k = q.to(dtype), k.to(dtype)
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return threshold_attention_weights(q, k, self.beta.to(dtype), self.power, self.scale)

    def extra_repr(self) -> str:
        learned = "learned" if isinstance(self.beta, nn.Parameter) else "fixed"
        return f"beta={learned}, power={self.power}, qk_norm={self.qk_norm}, scale={self.scale}"


class ThresholdAttention(Attention):
    """Causal threshold rectified attention, optionally followed by a per-head RMSNorm (`out_norm`).

    Variant kwargs: see ThresholdMap. With qk_norm the scores are cosines in [-1, 1], so beta and
    scale set the threshold in cosine units; without it, scale = 1 leaves q.k unscaled.
    """

    max_head_dim = MAX_HEAD_DIM  # the ops' limit

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        layer_index: int = 0,
        *,
        n_kv_heads: int | None = None,
        key_conv: int = 0,
        beta: float = 1.0,
        learn_beta: bool = True,
        power: float = 2.0,
        qk_norm: bool = False,
        out_norm: bool = True,
        scale: float = 1.0,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        self.threshold = ThresholdMap(
            n_heads, beta=beta, learn_beta=learn_beta, power=power, qk_norm=qk_norm, scale=scale
        )
        self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-5) if out_norm else nn.Identity()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.threshold(q, k, v))  # (B, H, Tq, Dh)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.threshold.weights(q, k)  # (B, H, Tq, Tk)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        return {"beta": self.threshold.beta}  # (H,)
