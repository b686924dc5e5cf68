"""Threshold attention as two torch.library custom ops (forward, backward) joined by register_autograd.

Why `custom_op` rather than `triton_op` + `wrap_triton`: one op serves both backends (the Triton kernels
and the blockwise PyTorch loop of chunked.py), and torch.compile sees it as one opaque node with a fake
impl, so it neither retraces the Python block loop nor the kernels' launch logic; both backends behave
the same under compile, export and CUDA graphs. Only q, k, v and beta are saved, and with skip_zero the
forward's tile map (an int8 output, not differentiable); backward recomputes.
Eager calls on plain tensors run the same two functions through an autograd.Function instead
(`threshold_attention_apply`): the op's Python dispatch would cost several times more host time per call;
eager calls that cannot record a gradient run the forward alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import forward_ad

from lit_thresh.ops.chunked import chunked_backward, chunked_forward


def _output_like(q: torch.Tensor, dv: int, backend: str) -> torch.Tensor:
    """An empty (B, Hq, Tq, Dv) output laid out as the backend writes it."""
    b, hq, tq, _ = q.shape
    if backend == "triton":
        from lit_thresh.ops.triton_launch import _empty_like_layout

        return _empty_like_layout(q, (b, hq, tq, dv))
    return q.new_empty(b, hq, tq, dv)


def _no_map(q: torch.Tensor) -> torch.Tensor:
    """The map output of a call that writes none: an empty int8 tensor."""
    return q.new_empty(0, dtype=torch.int8)


def _eager_forward(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32 (float64 for float64 inputs)
    power: float,
    scale: float,
    backend: str,
    skip_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward on checked inputs (see api.threshold_attention): (out (B, Hq, Tq, Dv), map). backend:
    'triton' or 'torch'; skip_zero: the Triton forward also writes the tile map its backward skips by
    (triton_launch.triton_forward); map is None where none is written (the torch backend has nothing to
    skip)."""
    if q.numel() == 0:
        return _output_like(q, v.shape[-1], backend).zero_(), None
    if backend == "triton":
        from lit_thresh.ops.triton_launch import triton_forward

        return triton_forward(q, k, v, beta, power, scale, skip_zero=skip_zero)
    return chunked_forward(q, k, v, beta, power, scale), None  # (B, Hq, Tq, Dv)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, power: float, scale: float,
             backend: str, skip_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """_eager_forward as the custom op returns it: the map an empty int8 tensor where none is written."""
    out, live = _eager_forward(q, k, v, beta, power, scale, backend, skip_zero)
    return out, _no_map(q) if live is None else live


def _eager_backward(
    dout: torch.Tensor,  # (B, Hq, Tq, Dv)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    power: float,
    scale: float,
    backend: str,
    need_dbeta: bool,
    skip_zero: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dbeta) laid out as torch.empty_like(q, k, v, beta); dbeta is None unless need_dbeta.
    live: the forward's tile map, saved when skip_zero (None: none)."""
    if q.numel() == 0:
        dbeta = torch.zeros_like(beta) if need_dbeta else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbeta
    if backend == "triton":
        from lit_thresh.ops.triton_launch import triton_backward

        return triton_backward(q, k, v, beta, power, scale, dout, need_dbeta, skip_zero=skip_zero, live=live)
    dq, dk, dv, dbeta = chunked_backward(q, k, v, beta, power, scale, dout, need_dbeta)
    return dq, dk, dv, dbeta if need_dbeta else None


def _backward(
    dout: torch.Tensor,  # (B, Hq, Tq, Dv)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    power: float,
    scale: float,
    backend: str,
    need_dbeta: bool,
    skip_zero: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_eager_backward as the custom op returns it: dbeta zeros where it is not needed."""
    dq, dk, dv, dbeta = _eager_backward(dout, q, k, v, beta, power, scale, backend, need_dbeta, skip_zero, live)
    return dq, dk, dv, torch.zeros_like(beta) if dbeta is None else dbeta


threshold_attention_op = torch.library.custom_op("lit_thresh::threshold_attention", _forward, mutates_args=())
threshold_attention_backward_op = torch.library.custom_op(
    "lit_thresh::threshold_attention_backward", _backward, mutates_args=()
)


@threshold_attention_op.register_fake
def _(q, k, v, beta, power, scale, backend, skip_zero=False):
    out = _output_like(q, v.shape[-1], backend)
    if backend != "triton" or not skip_zero or q.numel() == 0:
        return out, _no_map(q)
    from lit_thresh.ops.triton_launch import map_shape

    return out, q.new_empty(map_shape(q, k, v), dtype=torch.int8)


@threshold_attention_backward_op.register_fake
def _(dout, q, k, v, beta, power, scale, backend, need_dbeta, skip_zero=False, live=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, beta, power, scale, backend, skip_zero = inputs
    ctx.save_for_backward(q, k, v, beta, *((output[1],) if skip_zero else ()))
    ctx.power, ctx.scale, ctx.backend, ctx.skip_zero = power, scale, backend, skip_zero


def _grads(ctx, dout: torch.Tensor, _dmap: torch.Tensor | None = None, backward=threshold_attention_backward_op):
    q, k, v, beta, *live = ctx.saved_tensors
    live = live[0] if live else None
    need_dbeta = ctx.needs_input_grad[3]
    dq, dk, dv, dbeta = backward(dout, q, k, v, beta, ctx.power, ctx.scale, ctx.backend, need_dbeta, ctx.skip_zero,
                                 live)
    return dq, dk, dv, dbeta if need_dbeta else None, None, None, None, None


threshold_attention_op.register_autograd(_grads, setup_context=_setup_context)


class _EagerThresholdAttention(torch.autograd.Function):
    """The same forward and backward for eager calls: an autograd.Function costs less host time per
    call than the custom op's dispatch (Python autograd and schema handling)."""

    @staticmethod
    def forward(ctx, *inputs) -> torch.Tensor:  # not setup_context: Function.apply would inspect.signature
        *inputs, prepared = inputs  # prepared: a call plan's forward (None: the launcher's path)
        if prepared is None:
            out, live = _eager_forward(*inputs)  # live saved only with skip_zero, which writes one
        else:
            out, live = prepared(*inputs[:4]), None
        _setup_context(ctx, inputs, (out, live))
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        return *_grads(ctx, dout, None, _eager_backward), None


def records_nothing(*inputs: torch.Tensor) -> bool:
    """Whether an eager call on `inputs` has no gradient to record: grad mode off or no input requiring
    one, and no forward-mode tangent (those still reach the autograd.Function, which refuses them)."""
    if torch.is_grad_enabled():
        for t in inputs:  # loops, not generators: this runs at every eager call
            if t.requires_grad:
                return False
    if forward_ad._current_level < 0:  # no dual level entered: no tangents (unpack_dual's own shortcut)
        return True
    for t in inputs:
        if forward_ad.unpack_dual(t).tangent is not None:
            return False
    return True


def threshold_attention_apply(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, power: float, scale: float, backend: str,
    skip_zero: bool = False, prepared: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The op on checked inputs: the custom op while tracing (torch.compile, export, fake tensors),
    else the same code as an autograd.Function, or with no gradient to record (no_grad, inference,
    no input requiring one, no forward-mode tangent) the forward alone. prepared: the forward a call
    plan prepared for these inputs (triton_launch.PreparedForward), launched in place of the launcher's
    path unless a backward needs skip_zero's tile map (which it does not write)."""
    if type(q) is torch.Tensor and not torch.compiler.is_compiling():
        if records_nothing(q, k, v, beta):  # no autograd node, no backward to write a map for
            if prepared is not None:
                return prepared(q, k, v, beta)
            return _eager_forward(q, k, v, beta, power, scale, backend)[0]
        prepared = None if skip_zero else prepared
        return _EagerThresholdAttention.apply(q, k, v, beta, power, scale, backend, skip_zero, prepared)
    # a map only where a backward can follow
    skip_zero = skip_zero and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, beta))
    return threshold_attention_op(q, k, v, beta, power, scale, backend, skip_zero)[0]
