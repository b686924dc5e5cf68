"""The seed's names: `threshold_rela_triton` and `differential_threshold_rela_triton`, on lit_thresh's ops.

Unlike the model's `diff_threshold` variant (which learns an unclamped lambda), the differential form
here clamps lambda to [0, 1], as the seed does.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from lit_thresh.ops.api import check_power, differential_threshold_attention, threshold_attention


def threshold_rela_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor,
    relu_power: float = 2.0,
) -> torch.Tensor:
    """Seed-compatible name: ReLU(Q K^T - tau)^p V, causal. See threshold_attention."""
    return threshold_attention(q, k, v, beta, check_power(relu_power, "relu_power"))


def differential_threshold_rela_triton(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor,
    lambda_param: float | torch.Tensor,
    relu_power: float = 2.0,
    normalize: bool = True,
) -> torch.Tensor:
    """Seed-compatible differential form: A1 V - clamp(lambda, 0, 1) * A2 V (lambda clamped to [0, 1]),
    in one fused differential_threshold_attention call.

    q1, q2: (B, Hq, Tq, D); k1, k2: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv). With normalize, q and k
    are L2-normalised over the head dim first. lambda_param: float, 0-d or (Hq,) tensor; it gets
    a gradient when it requires grad (0 where clamped). A NaN lambda_param raises a ValueError
    (checked on the host, so it syncs; skipped under torch.compile).
    """
    power = check_power(relu_power, "relu_power")
    lam = _lambda_per_head(lambda_param, q1.shape[1] if isinstance(q1, torch.Tensor) else 0)
    if normalize:  # non-tensors pass through to the argument checks, which name them
        q1, q2, k1, k2 = (
            F.normalize(t, p=2.0, dim=-1) if isinstance(t, torch.Tensor) else t for t in (q1, q2, k1, k2)
        )
    return differential_threshold_attention(q1, q2, k1, k2, v, beta, lam, power)  # (B, Hq, Tq, Dv)


def _lambda_per_head(lambda_param: float | torch.Tensor, heads: int) -> float | torch.Tensor:
    """clamp(lambda, 0, 1) as a float or a 0-d / (Hq,) tensor (a float stays on the host: no copy, no sync)."""
    if isinstance(lambda_param, torch.Tensor):
        if lambda_param.dim() > 1 or lambda_param.numel() not in (1, heads):
            raise ValueError(
                f"lambda_param must be a float, a 0-d tensor or a ({heads},) tensor, got shape {tuple(lambda_param.shape)}"
            )
        if not lambda_param.is_floating_point():
            raise TypeError(f"lambda_param must be a floating-point tensor, got {lambda_param.dtype}")
        if not torch.compiler.is_compiling() and bool(lambda_param.isnan().any()):
            raise ValueError(f"lambda_param must not be NaN, got {lambda_param.detach().cpu().tolist()}")
        return lambda_param.clamp(0.0, 1.0)
    if isinstance(lambda_param, bool) or not isinstance(lambda_param, numbers.Real) or not math.isfinite(lambda_param):
        raise TypeError(f"lambda_param must be a finite float or a tensor, got {lambda_param!r}")
    return min(max(float(lambda_param), 0.0), 1.0)
