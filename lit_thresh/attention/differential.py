"""Differential attention (Ye et al., 2024, "Differential Transformer"): the difference of two maps.

out = RMSNorm(A1 V - lambda A2 V) * (1 - lambda_init), with per-head RMSNorm and
lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 layer_index).
Each head's q and k are split into two halves (q1, k1) and (q2, k2) of dim Dh / 2 that share v, so
the projections have the size of standard attention's. lambda is not clamped (as in the paper).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch
from torch import nn

from lit_thresh.attention.base import Attention


class DifferentialAttention(Attention):
    """Differential attention; subclasses implement `attend_map`, one attention map applied to v."""

    qk_groups = 2

    def __init__(
        self, d_model: int, n_heads: int, layer_index: int = 0, *, n_kv_heads: int | None = None, key_conv: int = 0
    ) -> None:
        super().__init__(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
        # (Dq,) each, N(0, 0.1) as in the paper's code
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(0.1 * torch.randn(self.qk_head_dim)) for _ in range(4)
        )
        self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-5)

    def lambda_full(self) -> torch.Tensor:
        """The 0-d lambda weighting the second map."""
        lambda_1 = torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
        lambda_2 = torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
        return lambda_1 - lambda_2 + self.lambda_init

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q1, q2 = q.chunk(2, dim=1)  # (B, H, Tq, Dq) each
        k1, k2 = k.chunk(2, dim=1)  # (B, Hkv, Tk, Dq) each
        y = self.attend_map(q1, k1, v) - self.lambda_full() * self.attend_map(q2, k2, v)  # (B, H, Tq, Dh)
        return self.out_norm(y) * (1 - self.lambda_init)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The effective map A1 - lambda A2 (B, H, Tq, Tk), whose product with v `attend` normalises."""
        q1, q2 = q.chunk(2, dim=1)  # (B, H, Tq, Dq) each
        k1, k2 = k.chunk(2, dim=1)  # (B, Hkv, Tk, Dq) each
        return self.map_weights(q1, k1) - self.lambda_full() * self.map_weights(q2, k2)  # (B, H, Tq, Tk)

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        return {"lambda": self.lambda_full()}  # 0-d

    @abstractmethod
    def attend_map(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, Tq, Dq), k (B, Hkv, Tk, Dq), v (B, Hkv, Tk, Dh) -> (B, H, Tq, Dh), causal."""

    @abstractmethod
    def map_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The map attend_map applies to v, in plain PyTorch (at least float32):
        q (B, H, Tq, Dq), k (B, Hkv, Tk, Dq) -> (B, H, Tq, Tk), zero on future keys."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_init={self.lambda_init:.4f}"
