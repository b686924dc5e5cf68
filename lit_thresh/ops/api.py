"""Public threshold attention functions: argument checks, then the autograd.Function."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from lit_thresh.ops.function import Backend, ThresholdAttentionFunction, resolve_backend

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_power(power: float | torch.Tensor, name: str) -> float:
    if isinstance(power, torch.Tensor):
        if power.numel() != 1:
            raise ValueError(f"{name} must be a single number, got a tensor of shape {tuple(power.shape)}")
        power = power.item()
    if isinstance(power, bool) or not isinstance(power, numbers.Real):
        raise TypeError(f"{name} must be a float > 0, got {type(power).__name__}")
    power = float(power)
    if not math.isfinite(power) or power <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {power}")
    return power


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, hq, tq, d), (bk, hkv, tk, dk), (bv, hv, tv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        raise ValueError(f"q, k and v must share the batch size, got {b}, {bk}, {bv}")
    if hkv != hv:
        raise ValueError(f"k and v must have the same number of heads, got {hkv} and {hv}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hkv}) (grouped-query attention)")
    if d != dk:
        raise ValueError(f"q and k must have the same head dim, got {d} and {dk}")
    if tk != tv:
        raise ValueError(f"k and v must have the same sequence length, got {tk} and {tv}")
    if tq > tk:
        raise ValueError(f"q's sequence length ({tq}) must be <= k's ({tk}): queries are the last Tq positions")
    for name, dim in (("q/k", d), ("v", dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim must be in [1, {MAX_HEAD_DIM}], got {dim}")


def _beta_per_head(beta: float | torch.Tensor, heads: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """beta as a contiguous (Hq,) tensor, float32 (float64 for float64 q); autograd carries the
    gradient back to beta's own shape and dtype."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(beta, torch.Tensor):
        if beta.dim() > 1 or beta.numel() not in (1, heads):
            raise ValueError(f"beta must be a float, a 0-d tensor or a ({heads},) tensor (one per head), got shape {tuple(beta.shape)}")
        if not beta.is_floating_point():
            raise TypeError(f"beta must be a floating-point tensor, got {beta.dtype}")
        if beta.device != device:
            raise ValueError(f"beta must be on the device of q ({device}), got {beta.device}")
        return beta.to(dtype).reshape(-1).expand(heads).contiguous()
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta):
        raise TypeError(f"beta must be a finite float or a tensor, got {beta!r}")
    return torch.full((heads,), float(beta), device=device, dtype=dtype)


def threshold_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor = 1.0,
    power: float = 2.0,
    *,
    scale: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal threshold rectified attention: out_i = sum_{j<=pos_i} ReLU(scale q_i.k_j - tau_i)^p v_j.

    q: (B, Hq, Tq, D); k: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv); any strides; Hq % Hkv == 0 (GQA);
    Tq <= Tk, the queries being the last Tq positions (KV-cache decoding); D, Dv <= 256.
    tau_i = beta_h * sqrt(2 ln(pos_i + 1) / D); beta is a float, a 0-d tensor or (Hq,), and gets
    its gradient when it requires grad. power: p > 0 (1 and 2 are fast paths).
    backend: 'auto' (Triton on CUDA, or on CPU under TRITON_INTERPRET=1; else blockwise PyTorch),
    'triton' or 'torch'. Under autocast, q, k and v are cast to the autocast dtype.
    Returns (B, Hq, Tq, Dv) in the input dtype.
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    _check_qkv(q, k, v)
    power = _check_power(power, "power")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    beta_h = _beta_per_head(beta, q.shape[1], q.device, q.dtype)  # (Hq,)
    if q.numel() == 0:  # an empty batch or no queries
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    return ThresholdAttentionFunction.apply(q, k, v, beta_h, power, float(scale), resolve_backend(backend, q))


def threshold_rela_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor,
    relu_power: float = 2.0,
) -> torch.Tensor:
    """Seed-compatible name: ReLU(Q K^T - tau)^p V, causal. See threshold_attention."""
    return threshold_attention(q, k, v, beta, _check_power(relu_power, "relu_power"))


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
    """Seed-compatible differential form: A1 V - clamp(lambda, 0, 1) * A2 V.

    q1, q2: (B, Hq, Tq, D); k1, k2: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv). With normalize, q and k
    are L2-normalised over the head dim first. lambda_param: float, 0-d or (Hq,) tensor; it gets
    a gradient when it requires grad.
    """
    power = _check_power(relu_power, "relu_power")
    lam = _lambda_per_head(lambda_param, q1.shape[1] if isinstance(q1, torch.Tensor) else 0)
    if normalize:
        q1, q2, k1, k2 = (F.normalize(t, p=2.0, dim=-1) for t in (q1, q2, k1, k2))
    out1 = threshold_attention(q1, k1, v, beta, power)  # (B, Hq, Tq, Dv)
    out2 = threshold_attention(q2, k2, v, beta, power)  # (B, Hq, Tq, Dv)
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=out1.device, dtype=out1.dtype)
    return out1 - lam * out2


def _lambda_per_head(lambda_param: float | torch.Tensor, heads: int) -> float | torch.Tensor:
    """clamp(lambda, 0, 1) as a float or a (1|Hq, 1, 1) tensor (a float stays on the host: no copy, no sync)."""
    if isinstance(lambda_param, torch.Tensor):
        if lambda_param.dim() > 1 or lambda_param.numel() not in (1, heads):
            raise ValueError(
                f"lambda_param must be a float, a 0-d tensor or a ({heads},) tensor, got shape {tuple(lambda_param.shape)}"
            )
        return lambda_param.clamp(0.0, 1.0).reshape(-1, 1, 1)
    if isinstance(lambda_param, bool) or not isinstance(lambda_param, numbers.Real) or not math.isfinite(lambda_param):
        raise TypeError(f"lambda_param must be a finite float or a tensor, got {lambda_param!r}")
    return min(max(float(lambda_param), 0.0), 1.0)
