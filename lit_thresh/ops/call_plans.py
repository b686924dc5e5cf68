"""Plans of eager threshold-attention calls that repeat a signature: the checks they passed, and the forward
launch prepared for them.

A call's signature holds everything the op's checks and its launch depend on: the tensors' exact types,
shapes, strides, dtypes, devices and 16-byte alignments, beta's (a tensor or an nn.Parameter; a float by
value), the other arguments by type and value, and the global state the call reads (fp32 matmul precision,
inference mode; for CUDA tensors the current device and CUDA-graph capture, for CPU tensors
TRITON_INTERPRET). The second time a signature comes, its plan is kept; from the third on, the call skips
the checks it passed, and on CUDA its forward launches the prepared kernel (triton_launch.PreparedForward)
instead of going through the launcher, with or without a gradient to record (but not where a backward will
skip by skip_zero's tile map): lit_thresh/ops/PERF.md v21. The differential op's calls are planned the same
way (differential_signature; its forward prepared by triton_differential.prepare_diff_forward). Calls under
torch.compile or functorch transforms (vmap), or on tensor subclasses, have no signature and always take the
checked path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lit_thresh.ops.backend import triton_interpreting

MAX_PLANS = 256  # signatures kept; shapes that change at every call (decoding) refill it


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a checked call of one signature resolved to: the backend, power and scale as the op takes them,
    beta's (Hq,) tensor where the call gave a float (None: beta as given, already an (Hq,) float32
    tensor; see beta_converted), and the forward prepared for its inputs (None: the op's own path)."""

    backend: str
    power: float
    scale: float
    beta: torch.Tensor | None
    beta_converted: bool  # a tensor beta that the op converts at each call (another shape or dtype)
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None


@dataclass(frozen=True, slots=True)
class DifferentialPlan:
    """What a checked call of the differential op resolved to: as CallPlan's fields, for beta and for lam, and
    its prepared forward (triton_differential.PreparedDiffForward)."""

    backend: str
    power: float
    scale: float
    beta: torch.Tensor | None
    beta_converted: bool
    lam: torch.Tensor | None
    lam_converted: bool
    forward: Callable[..., torch.Tensor] | None


_PLANS: dict[tuple, CallPlan | DifferentialPlan | None] = {}  # signature -> its plan, or None once seen
_TENSOR_BETAS = (torch.Tensor, torch.nn.Parameter)  # a model's beta is a Parameter when it is learned
_CAPTURING = 2  # where the signature's device state says that a CUDA graph is being captured


def signature(q: object, k: object, v: object, beta: object, power: object, scale: object, backend: object,
              skip_zero: object) -> tuple | None:
    """The call's signature, or None where calls are not planned (torch.compile tracing, tensor subclasses,
    functorch transforms such as vmap, a beta neither a tensor nor a float). Its last entry, the device state
    (_device_state); inference mode before it."""
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor:
        return None
    if type(v) is not torch.Tensor:
        return None
    try:
        alignments = (q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)
        beta_key = _per_head_key(beta)
    except (TypeError, RuntimeError):  # a beta neither tensor nor float; functorch-wrapped tensors
        return None
    precision = torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, alignments, type(beta), beta_key, type(power), power, type(scale), scale,
            type(backend), backend, type(skip_zero), skip_zero, precision, torch.is_inference_mode_enabled(),
            _device_state(q))


def _per_head_key(x: object) -> object:
    """A beta's or lam's part of a signature: a tensor's (or Parameter's) layout, a float's value; raises
    TypeError for anything else (no plan) and RuntimeError for a tensor without storage (functorch)."""
    if type(x) in _TENSOR_BETAS:
        return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15
    if type(x) is float:
        return x
    raise TypeError


def _device_state(q: torch.Tensor) -> tuple:
    """A signature's last entry: for CUDA tensors (True, the current device, whether a CUDA graph is being
    captured), for others (False, whether TRITON_INTERPRET is on, on which the 'auto' backend depends, False)."""
    if q.is_cuda:
        return True, torch.cuda.current_device(), torch.cuda.is_current_stream_capturing()
    return False, triton_interpreting(), False


def differential_signature(q1: object, q2: object, k1: object, k2: object, v: object, beta: object, lam: object,
                           power: object, scale: object, backend: object) -> tuple | None:
    """The differential op's signature, as signature's (its last entry the same device state), or None where
    its calls are not planned."""
    if torch.compiler.is_compiling():
        return None
    tensors = (q1, q2, k1, k2, v)
    for t in tensors:
        if type(t) is not torch.Tensor:
            return None
    try:
        layouts = tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors)
        beta_key, lam_key = _per_head_key(beta), _per_head_key(lam)
    except (TypeError, RuntimeError):  # a beta or lam neither tensor nor float; functorch-wrapped tensors
        return None
    precision = torch.get_float32_matmul_precision() if q1.dtype == torch.float32 else None
    return ("differential", layouts, type(beta), beta_key, type(lam), lam_key, type(power), power, type(scale), scale,
            type(backend), backend, precision, torch.is_inference_mode_enabled(), _device_state(q1))


def plan_for(key: tuple | None) -> CallPlan | DifferentialPlan | None:
    """The plan kept for a signature (None: none yet, or no signature; or an unhashable argument, which the
    checks then refuse)."""
    if key is None:
        return None
    try:
        return _PLANS.get(key)
    except TypeError:  # e.g. scale=[1.0]: the checked path names it
        return None


def remember(key: tuple | None, make: Callable[[], CallPlan | DifferentialPlan]) -> None:
    """After a checked call of signature `key`: the first time, note it; the second, keep make()'s plan. Not
    while a CUDA graph is captured (its tensors belong to the graph)."""
    if key is None or key[-1][_CAPTURING]:
        return
    if key in _PLANS:
        _PLANS[key] = make()
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = None
