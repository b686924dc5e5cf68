"""The public threshold attention function: argument checks, then the custom op (function.py)."""

from __future__ import annotations

import math
import numbers

import torch

from lit_thresh.ops import call_plans
from lit_thresh.ops.backend import Backend, resolve_backend
from lit_thresh.ops.differential_function import differential_threshold_attention_apply
from lit_thresh.ops.function import threshold_attention_apply

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)  # membership by hash: cheaper per call than the tuple


def check_power(power: float, name: str) -> float:
    """power as a float; a tensor is refused (reading it would sync with the device)."""
    if type(power) is float and 0.0 < power < math.inf:  # the common case, cheaply
        return power
    if isinstance(power, bool) or not isinstance(power, numbers.Real):
        raise TypeError(f"{name} must be a float > 0 (not a tensor), got {type(power).__name__}")
    power = float(power)
    if not math.isfinite(power) or power <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {power}")
    return power


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    """Shapes, dtypes and devices of q, k and v; errors call them `names` (("q1", "k1", "v") for the differential op)."""
    nq, nk, nv = names
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPE_SET:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{nq}, {nk} and {nv} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{nq}, {nk} and {nv} must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, hq, tq, d), (bk, hkv, tk, dk), (bv, hv, tv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        raise ValueError(f"{nq}, {nk} and {nv} must share the batch size, got {b}, {bk}, {bv}")
    if hkv != hv:
        raise ValueError(f"{nk} and {nv} must have the same number of heads, got {hkv} and {hv}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{nq}'s heads ({hq}) must be a multiple of {nk}'s and {nv}'s heads ({hkv}) (grouped-query attention)"
        )
    if d != dk:
        raise ValueError(f"{nq} and {nk} must have the same head dim, got {d} and {dk}")
    if tk != tv:
        raise ValueError(f"{nk} and {nv} must have the same sequence length, got {tk} and {tv}")
    if tq > tk:
        raise ValueError(f"{nq}'s sequence length ({tq}) must be <= {nk}'s ({tk}): queries are the last Tq positions")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{nq}/{nk} head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    if not 1 <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"{nv} head dim must be in [1, {MAX_HEAD_DIM}], got {dv}")


def _beta_per_head(
    beta: float | torch.Tensor, heads: int, device: torch.device, dtype: torch.dtype, name: str = "beta"
) -> torch.Tensor:
    """beta (or another per-head scalar, called `name` in errors) as a contiguous (Hq,) tensor, float32
    (float64 for float64 q); autograd carries the gradient back to beta's own shape and dtype."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(beta, torch.Tensor):
        if beta.dim() > 1 or beta.numel() not in (1, heads):
            raise ValueError(f"{name} must be a float, a 0-d tensor or a ({heads},) tensor (one per head), got shape {tuple(beta.shape)}")
        if not beta.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {beta.dtype}")
        if beta.device != device:
            raise ValueError(f"{name} must be on the device of the queries ({device}), got {beta.device}")
        if beta.shape == (heads,) and beta.dtype == dtype and beta.is_contiguous():  # a model's (H,) parameter: as it is
            return beta
        return beta.to(dtype).reshape(-1).expand(heads).contiguous()
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta):
        raise TypeError(f"{name} must be a finite float or a tensor, got {beta!r}")
    return torch.full((heads,), float(beta), device=device, dtype=dtype)


def _device_type(t: torch.Tensor) -> str:
    """t.device.type, for CUDA tensors without building a device object (host time per call)."""
    return "cuda" if t.is_cuda else t.device.type


def threshold_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor = 1.0,
    power: float = 2.0,
    *,
    scale: float = 1.0,
    backend: Backend = "auto",
    skip_zero: bool = False,
) -> torch.Tensor:
    """Causal threshold rectified attention: out_i = sum_{j<=pos_i} ReLU(scale q_i.k_j - tau_i)^p v_j.

    q: (B, Hq, Tq, D); k: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv); any strides; Hq % Hkv == 0 (GQA);
    Tq <= Tk, the queries being the last Tq positions (KV-cache decoding); D, Dv <= 256.
    tau_i = beta_h * sqrt(2 ln(pos_i + 1) / D); beta is a float, a 0-d tensor or (Hq,), and gets
    its gradient when it requires grad. power: p > 0 (1 and 2 are fast paths).
    backend: 'auto' (Triton on CUDA, or on CPU under TRITON_INTERPRET=1, for B * Hq <= 65535; else blockwise
    PyTorch), 'triton' or 'torch'. Under autocast, q, k and v are cast to the autocast dtype.
    skip_zero: the Triton forward marks the tiles whose weights are all exactly 0 and the backward skips
    them; the same result for finite v (and gradient). For training on long maps with most tiles all
    zero: on an H200 at T = 16384 forward+backward took 0.27-0.31x the time at 99% zero weights, 1.00-1.07x
    at 0-90%; on an under-trained char model's maps at T = 2048 0.37-0.89x replayed from CUDA graphs but
    1.15-1.48x in eager calls (likely host time), and at T = 256 eager 1.6-2.2x. A call with no gradient
    to record runs as without it: lit_thresh/ops/PERF.md v7, v13 and session 18.
    Returns (B, Hq, Tq, Dv) in the input dtype.
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(device_type := _device_type(q)):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    key = call_plans.signature(q, k, v, beta, power, scale, backend, skip_zero)
    plan = call_plans.plan_for(key)
    if plan is None:  # the checks, then the op; the signature's plan kept once it comes again
        return _checked_threshold_attention(q, k, v, beta, power, scale, backend, skip_zero, key)
    beta = _planned_per_head(beta, plan.beta, plan.beta_converted, q)
    return threshold_attention_apply(q, k, v, beta, plan.power, plan.scale, plan.backend, skip_zero, plan.forward)


def _planned_per_head(given: float | torch.Tensor, kept: torch.Tensor | None, converted: bool, q: torch.Tensor,
                      name: str = "beta") -> float | torch.Tensor:
    """A planned call's beta or lam: the (Hq,) tensor its plan kept of a float, else `given` converted as the
    checks converted it, or as given where they took it as it was (_kept_per_head made kept and converted)."""
    if kept is not None:
        return kept
    if converted:
        return _beta_per_head(given, q.shape[1], q.device, q.dtype, name)
    return given


def _kept_per_head(given: object, per_head: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """What a call's plan keeps of a beta or lam `given`, which the checks made per_head (Hq,): the tensor made of
    a float (later calls reuse it) or None, and whether a tensor given is converted again at each call."""
    kept = per_head if type(given) is float else None
    return kept, kept is None and per_head is not given


def _checked_threshold_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: float | torch.Tensor, power: float, scale: float,
    backend: Backend, skip_zero: bool, key: tuple | None,
) -> torch.Tensor:
    """threshold_attention after autocast: its checks, the op, then the call's plan noted under key
    (call_plans.remember)."""
    _check_qkv(q, k, v)
    power = check_power(power, "power")
    if not (type(scale) is float and math.isfinite(scale)):  # the common case first, cheaply
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise TypeError(f"scale must be a finite float, got {scale!r}")
        scale = float(scale)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if type(skip_zero) is not bool:
        raise TypeError(f"skip_zero must be a bool, got {skip_zero!r}")
    beta_h = _beta_per_head(beta, q.shape[1], q.device, q.dtype)  # (Hq,)
    backend = resolve_backend(backend, q)
    out = threshold_attention_apply(q, k, v, beta_h, power, scale, backend, skip_zero)

    def plan() -> call_plans.CallPlan:
        forward = None
        if backend == "triton" and q.numel():
            from lit_thresh.ops.triton_launch import prepare_forward

            forward = prepare_forward(q, k, v, beta_h, power, scale)
        constant_beta, converted = _kept_per_head(beta, beta_h)
        if constant_beta is not None and constant_beta.is_cuda:  # filled on this stream, read on any later
            torch.cuda.current_stream(constant_beta.device).synchronize()
        return call_plans.CallPlan(backend, power, scale, constant_beta, converted, forward)

    call_plans.remember(key, plan)
    return out


def _check_same(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    """a and b are 4-d tensors of one shape, dtype and device (the two halves of a differential op)."""
    for name, t in ((name_a, a), (name_b, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"{name_b} must have the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name_b} must have the dtype of {name_a} ({a.dtype}), got {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name_b} must be on the device of {name_a} ({a.device}), got {b.device}")


def differential_threshold_attention(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: float | torch.Tensor,
    lam: float | torch.Tensor,
    power: float = 2.0,
    *,
    scale: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Fused causal differential threshold attention: (ReLU(x1)^p - lam_h ReLU(x2)^p) V in one op,
    x_m = scale q_m k_m^T - tau (m = 1, 2), both maps sharing beta (so tau) and v; lam is not clamped.

    q1, q2: (B, Hq, Tq, D); k1, k2: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv); other conventions (strides,
    GQA, Tq <= Tk, D and Dv <= 256, power, backend, autocast) as in threshold_attention. beta and lam:
    each a float, a 0-d tensor or (Hq,), with gradients when they require grad.
    Returns (B, Hq, Tq, Dv) in the input dtype; equals threshold_attention(q1, k1, v, beta, power) -
    lam * threshold_attention(q2, k2, v, beta, power) at one pass over v.
    """
    if isinstance(q1, torch.Tensor) and torch.is_autocast_enabled(device_type := _device_type(q1)):
        dtype = torch.get_autocast_dtype(device_type)
        q1, q2, k1, k2, v = (
            t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q1, q2, k1, k2, v)
        )
    key = call_plans.differential_signature(q1, q2, k1, k2, v, beta, lam, power, scale, backend)
    plan = call_plans.plan_for(key)
    if plan is None:  # the checks, then the op; the signature's plan kept once it comes again
        return _checked_differential_threshold_attention(q1, q2, k1, k2, v, beta, lam, power, scale, backend, key)
    beta = _planned_per_head(beta, plan.beta, plan.beta_converted, q1)
    lam = _planned_per_head(lam, plan.lam, plan.lam_converted, q1, "lam")
    return differential_threshold_attention_apply(q1, q2, k1, k2, v, beta, lam, plan.power, plan.scale, plan.backend,
                                                  plan.forward)


def _checked_differential_threshold_attention(
    q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, v: torch.Tensor,
    beta: float | torch.Tensor, lam: float | torch.Tensor, power: float, scale: float, backend: Backend,
    key: tuple | None,
) -> torch.Tensor:
    """differential_threshold_attention after autocast: its checks, the op, then the call's plan noted under
    key (call_plans.remember)."""
    _check_same(q1, q2, "q1", "q2")
    _check_same(k1, k2, "k1", "k2")
    _check_qkv(q1, k1, v, ("q1", "k1", "v"))
    power = check_power(power, "power")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    scale = float(scale)
    heads = q1.shape[1]
    beta_h = _beta_per_head(beta, heads, q1.device, q1.dtype)  # (Hq,)
    lam_h = _beta_per_head(lam, heads, q1.device, q1.dtype, name="lam")  # (Hq,)
    backend = resolve_backend(backend, q1)
    out = differential_threshold_attention_apply(q1, q2, k1, k2, v, beta_h, lam_h, power, scale, backend)

    def plan() -> call_plans.DifferentialPlan:
        forward = None
        if backend == "triton" and q1.numel():
            from lit_thresh.ops.triton_differential import prepare_diff_forward

            forward = prepare_diff_forward(q1, q2, k1, k2, v, beta_h, lam_h, power, scale)
        kept_beta, kept_lam = _kept_per_head(beta, beta_h), _kept_per_head(lam, lam_h)
        if q1.is_cuda and (kept_beta[0] is not None or kept_lam[0] is not None):  # filled on this stream
            torch.cuda.current_stream(q1.device).synchronize()
        return call_plans.DifferentialPlan(backend, power, scale, *kept_beta, *kept_lam, forward)

    call_plans.remember(key, plan)
    return out
