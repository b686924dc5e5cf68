"""Differential threshold attention: A1 V - lambda A2 V with threshold rectified maps."""

from __future__ import annotations

import torch

from lit_thresh.attention.differential import DifferentialAttention
from lit_thresh.attention.threshold import ThresholdMap
from lit_thresh.ops.api import MAX_HEAD_DIM, differential_threshold_attention


class DiffThresholdAttention(DifferentialAttention):
    """Differential attention (see DifferentialAttention) over two threshold maps that share beta (and,
    with learn_scale, the per-head score scale g: RMSNorm(A1 V - lambda A2 V) then depends on beta and
    g only through beta / g, as ThresholdMap explains).

    Variant kwargs: see ThresholdMap; q and k are L2-normalised by default (qk_norm), as in the
    seed's differential kernel. lambda is unclamped, as in the Differential Transformer; both maps
    run in one fused differential_threshold_attention call (V read once).
    """

    max_head_dim = MAX_HEAD_DIM  # the ops' limit, on v's head dim (q's and k's are half of it)

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
        qk_norm: bool = True,
        scale: float = 1.0,
        learn_scale: bool = False,
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        self.threshold = ThresholdMap(
            n_heads,
            beta=beta,
            learn_beta=learn_beta,
            power=power,
            qk_norm=qk_norm,
            scale=scale,
            learn_scale=learn_scale,
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The two maps in one fused op: A1 V - lambda A2 V, then the differential output norm."""
        th = self.threshold
        q1, q2 = q.chunk(2, dim=1)  # (B, H, Tq, Dq) each
        k1, k2 = k.chunk(2, dim=1)  # (B, Hkv, Tk, Dq) each
        (q1, k1), (q2, k2) = th.prepare(q1, k1), th.prepare(q2, k2)  # qk_norm, times g (learn_scale)
        y = differential_threshold_attention(
            q1, q2, k1, k2, v, th.beta, self.lambda_full(), th.power, scale=th.scale
        )  # (B, H, Tq, Dh)
        return self.out_norm(y) * (1 - self.lambda_init)

    def attend_map(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One of the two maps applied to v (attend fuses both)."""
        return self.threshold(q, k, v)  # (B, H, Tq, Dh)

    def map_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.threshold.weights(q, k)  # (B, H, Tq, Tk)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        return self.threshold.diagnostic_values() | super().diagnostic_values()  # beta, scale (H,); lambda 0-d
