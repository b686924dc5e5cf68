"""Threshold rectified attention: out_i = sum_{j <= i} ReLU(scale q_i.k_j - tau_i)^p v_j (lit_thresh.ops).

tau_i = beta_h * sqrt(2 ln(i + 1) / Dq) grows with the position i, so a query attends only to keys
that beat the noise level of i random scores. No softmax normalisation: the output of a head is a sum
of |{j: score > tau}| terms, hence the per-head RMSNorm on the output (`out_norm`, as in ReLA).
"""

from __future__ import annotations

import math

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
    (times `scale`); scale: score scale, 1 by default (no 1/sqrt(d)); learn_scale: the score scale
    is a learned per-head g_h = exp(log_scale_h) (an (H,) parameter, log_scale initialised at
    log(scale), positive at any step), multiplying q before the op, whose scale is then the float 1.

    What g does: ReLU(g s - beta gamma_i)^p = g^p ReLU(s - (beta / g) gamma_i)^p (s = q.k, gamma_i =
    sqrt(2 ln(i + 1) / Dq)), so a head's map is g_h^p times the map of threshold beta_h / g_h at
    scale 1. A positive factor common to a head's whole map is removed by a per-head output RMSNorm
    (`out_norm`, and the differential variant's norm of A1 V - lambda A2 V, whose maps share g) up to
    its eps: with it, the output depends on (beta_h, g_h) only through beta_h / g_h, and a learned g
    adds nothing that a learned beta cannot express. It changes the optimisation (Adam moves log g
    by about lr a step: the threshold beta / g moves by a relative step, where beta moves by an
    absolute one, and keeps beta's sign), the map's size against RMSNorm's eps (a larger g^p: eps
    matters less), and, without out_norm, the output's magnitude (g^p). With learn_beta false it is
    the only learned part of the threshold. Without qk_norm, g_h also duplicates the norm of the
    head's rows of q_proj, but without weight decay.
    """

    def __init__(
        self,
        n_heads: int,
        *,
        beta: float,
        learn_beta: bool,
        power: float,
        qk_norm: bool,
        scale: float,
        learn_scale: bool = False,
    ) -> None:
        super().__init__()
        check_finite_float("beta", beta)
        check_finite_float("power", power, positive=True)
        check_finite_float("scale", scale, positive=True)
        if not isinstance(learn_scale, bool):
            raise TypeError(f"learn_scale must be a bool, got {type(learn_scale).__name__}")
        beta_h = torch.full((n_heads,), float(beta))  # (H,)
        if learn_beta:
            self.beta = nn.Parameter(beta_h)
        else:
            self.register_buffer("beta", beta_h)
        # log g_h, (H,); None: the score scale is the op's float `scale`
        self.log_scale = nn.Parameter(torch.full((n_heads,), math.log(scale))) if learn_scale else None
        self.power, self.qk_norm = float(power), qk_norm
        self.scale = 1.0 if learn_scale else float(scale)  # the op's: a constant to torch.compile

    def gain(self) -> torch.Tensor | None:
        """The learned score scale g (H,), or None when the scale is the float `scale`."""
        return None if self.log_scale is None else self.log_scale.exp()

    def prepare(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, Hkv, Tk, D) as the op takes them: L2-normalised (qk_norm), q times g_h
        (learn_scale); in q's and k's dtypes (autocast computes norms in float32)."""
        dtype = q.dtype
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1).to(k.dtype)
        if self.log_scale is not None:  # in float32 at least, then one rounding: g itself is not rounded
            q = q * self.log_scale.exp()[:, None, None]  # (H, 1, 1) over (B, H, Tq, D)
        return q.to(dtype), k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skip_zero: bool = False) -> torch.Tensor:
        """q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv), causal; skip_zero: as
        lit_thresh.ops.threshold_attention."""
        q, k = self.prepare(q, k)
        return threshold_attention(q, k, v, self.beta, self.power, scale=self.scale, skip_zero=skip_zero)

    def weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The map `forward` applies to v, as `threshold_attention_reference` computes it, in at least
        float32: q (B, H, Tq, D), k (B, Hkv, Tk, D) -> (B, H, Tq, Tk), exactly 0 on future keys."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        q, k = self.prepare(q.to(dtype), k.to(dtype))
        return threshold_attention_weights(q, k, self.beta.to(dtype), self.power, self.scale)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        """beta and, when learned, the score scale g: (H,) each."""
        gain = self.gain()
        return {"beta": self.beta} | ({} if gain is None else {"scale": gain})

    def extra_repr(self) -> str:
        learned = "learned" if isinstance(self.beta, nn.Parameter) else "fixed"
        scale = "learned" if self.log_scale is not None else self.scale
        return f"beta={learned}, power={self.power}, qk_norm={self.qk_norm}, scale={scale}"


class ThresholdAttention(Attention):
    """Causal threshold rectified attention, optionally followed by a per-head RMSNorm (`out_norm`).

    Variant kwargs: see ThresholdMap. With qk_norm the scores are cosines in [-1, 1], so beta and
    scale set the threshold in cosine units (beta / scale times the noise level sqrt(2 ln(i + 1) / Dq)
    of i random unit vectors' cosines); without it, scale = 1 leaves q.k unscaled. skip_zero: the
    backward kernels skip the tiles whose weights are all exactly 0 (the same output and gradients):
    a faster forward+backward of the op on maps that are mostly all-zero tiles, at long T or under CUDA
    graphs (`compile: reduce-overhead`) at shorter T; 0.5-7% slower on denser maps, and slower in eager calls
    at T = 256-2048 (lit_thresh.ops.threshold_attention); generation, which runs forwards only, is unchanged.
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
        learn_scale: bool = False,
        skip_zero: bool = False,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        if not isinstance(skip_zero, bool):
            raise TypeError(f"skip_zero must be a bool, got {type(skip_zero).__name__}")
        self.skip_zero = skip_zero
        self.threshold = ThresholdMap(
            n_heads,
            beta=beta,
            learn_beta=learn_beta,
            power=power,
            qk_norm=qk_norm,
            scale=scale,
            learn_scale=learn_scale,
        )
        self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-5) if out_norm else nn.Identity()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.threshold(q, k, v, self.skip_zero))  # (B, H, Tq, Dh)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.threshold.weights(q, k)  # (B, H, Tq, Tk)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        return self.threshold.diagnostic_values()  # (H,) each
