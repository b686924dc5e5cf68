"""Plain PyTorch threshold rectified attention: the ground truth every fast path is tested against.

out[b, h, i] = sum_{j <= pos_i} ReLU(scale * q_i . k_j - tau_{h,i})^p * v_j
tau_{h,i}    = beta_h * sqrt(2 * ln(pos_i + 1) / d),   d = head dim of q and k,
pos_i        = Tk - Tq + i (queries are the last Tq positions of the Tk keys).

Memory is O(Tq * Tk): use it for checking, not for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def threshold_positions(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """Absolute positions of the Tq queries: the last Tq of Tk. Shape (Tq,), int64."""
    return torch.arange(tk - tq, tk, device=device)


def threshold_gain(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(2 * ln(pos + 1) / d): tau = beta * gain. Shape like positions."""
    return torch.sqrt(2.0 * torch.log1p(positions.to(dtype)) / head_dim)


def rectified_power(x: torch.Tensor, power: float) -> torch.Tensor:
    """ReLU(x)^p: exactly 0 where x <= 0, NaN where x is NaN (as ReLU(NaN) = NaN); the gradient is
    finite wherever x is (also for p < 1)."""
    dead = x <= 0  # False for NaN
    safe = torch.where(dead, torch.ones_like(x), x)
    return torch.where(dead, torch.zeros_like(x), safe**power)


def threshold_attention_weights(
    q: torch.Tensor, k: torch.Tensor, beta: float | torch.Tensor = 1.0, power: float = 2.0, scale: float = 1.0
) -> torch.Tensor:
    """The causal map ReLU(scale q.k - tau)^p that threshold attention applies to v.

    q: (B, Hq, Tq, D); k: (B, Hkv, Tk, D); Hq % Hkv == 0, Tq <= Tk; beta: float, 0-d tensor or (Hq,)
    tensor. Returns (B, Hq, Tq, Tk) in q's dtype, exactly 0 on future keys for any beta.
    """
    _, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, Tk, D)

    beta = torch.as_tensor(beta, dtype=q.dtype, device=q.device).reshape(-1, 1, 1)  # (1|Hq, 1, 1)
    pos = threshold_positions(tq, tk, q.device)  # (Tq,)
    tau = beta * threshold_gain(pos, d, q.dtype)[:, None]  # (1|Hq, Tq, 1)

    scores = scale * (q @ k.transpose(-1, -2)) - tau  # (B, Hq, Tq, Tk)
    causal = torch.arange(tk, device=q.device)[None, :] <= pos[:, None]  # (Tq, Tk)
    return rectified_power(scores.masked_fill(~causal, 0.0), power)  # masked keys: exactly 0


def threshold_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor = 1.0,
    power: float = 2.0,
    scale: float = 1.0,
) -> torch.Tensor:
    """Causal threshold rectified attention, materialising the (Tq, Tk) weights.

    q: (B, Hq, Tq, D); k: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv); Hq % Hkv == 0, Tq <= Tk.
    beta: float, 0-d tensor or (Hq,) tensor. Returns (B, Hq, Tq, Dv) in q's dtype.
    """
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # (B, Hq, Tk, Dv)
    return threshold_attention_weights(q, k, beta, power, scale) @ v  # (B, Hq, Tq, Dv)


def differential_threshold_attention_reference(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor,
    lambda_param: float | torch.Tensor,
    power: float = 2.0,
    normalize: bool = True,
) -> torch.Tensor:
    """A1 V - clamp(lambda, 0, 1) * A2 V, with optional L2 normalisation of q and k.

    lambda_param: float, 0-d tensor or (Hq,) tensor (per head).
    """
    if normalize:
        q1, q2, k1, k2 = (F.normalize(t, p=2.0, dim=-1) for t in (q1, q2, k1, k2))
    out1 = threshold_attention_reference(q1, k1, v, beta, power)
    out2 = threshold_attention_reference(q2, k2, v, beta, power)
    lam = torch.as_tensor(lambda_param, dtype=out1.dtype, device=out1.device).clamp(0.0, 1.0)
    return out1 - lam.reshape(-1, 1, 1) * out2  # (1|Hq, 1, 1) broadcast over (B, Hq, Tq, Dv)
