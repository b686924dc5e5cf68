"""Fused differential threshold attention as two torch.library custom ops (forward, backward) joined by
register_autograd, as function.py does for the single op: one opaque node with a fake impl for both
backends (triton_differential.py's kernels, chunked_differential.py's block loop). Only the inputs
(q1, q2, k1, k2, v, beta, lambda) are saved; backward recomputes the scores. Eager calls on plain tensors
run the same two functions through an autograd.Function (`differential_threshold_attention_apply`), which
costs less host time per call than the op's dispatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lit_thresh.ops.chunked_differential import chunked_differential_backward, chunked_differential_forward
from lit_thresh.ops.function import _output_like, records_nothing


def _laid_out_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t with the strides torch.empty_like(like) has (what the fake impls promise); copied only if it differs."""
    if t.stride() == like.stride():
        return t
    target = torch.empty_like(like)
    return t if t.stride() == target.stride() else target.copy_(t)


def _forward(
    q1: torch.Tensor,  # (B, Hq, Tq, D)
    q2: torch.Tensor,  # (B, Hq, Tq, D)
    k1: torch.Tensor,  # (B, Hkv, Tk, D)
    k2: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32 (float64 for float64 inputs)
    lam: torch.Tensor,  # (Hq,) like beta
    power: float,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Forward on checked inputs (see api.differential_threshold_attention); backend: 'triton' or 'torch'."""
    if q1.numel() == 0:
        return _output_like(q1, v.shape[-1], backend).zero_()
    if backend == "triton":
        from lit_thresh.ops.triton_differential import diff_triton_forward

        return diff_triton_forward(q1, q2, k1, k2, v, beta, lam, power, scale)
    return chunked_differential_forward(q1, q2, k1, k2, v, beta, lam, power, scale)  # (B, Hq, Tq, Dv)


def _backward(
    dout: torch.Tensor,  # (B, Hq, Tq, Dv)
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    power: float,
    scale: float,
    backend: str,
    need_dbeta: bool,
    need_dlam: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq1, dq2, dk1, dk2, dv, dbeta, dlam) laid out as torch.empty_like of the inputs; dbeta / dlam are
    zeros unless asked for."""
    inputs = (q1, q2, k1, k2, v, beta, lam)
    if q1.numel() == 0:
        return tuple(torch.zeros_like(t) for t in inputs)
    if backend == "triton":
        from lit_thresh.ops.triton_differential import diff_triton_backward

        grads = diff_triton_backward(q1, q2, k1, k2, v, beta, lam, power, scale, dout, need_dbeta, need_dlam)
    else:
        grads = chunked_differential_backward(q1, q2, k1, k2, v, beta, lam, power, scale, dout, need_dbeta, need_dlam)
    return tuple(torch.zeros_like(t) if g is None else _laid_out_like(g, t) for g, t in zip(grads, inputs))


differential_threshold_attention_op = torch.library.custom_op(
    "lit_thresh::differential_threshold_attention", _forward, mutates_args=()
)
differential_threshold_attention_backward_op = torch.library.custom_op(
    "lit_thresh::differential_threshold_attention_backward", _backward, mutates_args=()
)


@differential_threshold_attention_op.register_fake
def _(q1, q2, k1, k2, v, beta, lam, power, scale, backend):
    return _output_like(q1, v.shape[-1], backend)


@differential_threshold_attention_backward_op.register_fake
def _(dout, q1, q2, k1, k2, v, beta, lam, power, scale, backend, need_dbeta, need_dlam):
    return tuple(torch.empty_like(t) for t in (q1, q2, k1, k2, v, beta, lam))


def _setup_context(ctx, inputs, output) -> None:
    q1, q2, k1, k2, v, beta, lam, power, scale, backend = inputs
    ctx.save_for_backward(q1, q2, k1, k2, v, beta, lam)
    ctx.power, ctx.scale, ctx.backend = power, scale, backend


def _grads(ctx, dout: torch.Tensor, backward=differential_threshold_attention_backward_op):
    need_dbeta, need_dlam = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    grads = backward(dout, *ctx.saved_tensors, ctx.power, ctx.scale, ctx.backend, need_dbeta, need_dlam)
    dq1, dq2, dk1, dk2, dv, dbeta, dlam = grads
    return dq1, dq2, dk1, dk2, dv, dbeta if need_dbeta else None, dlam if need_dlam else None, None, None, None


differential_threshold_attention_op.register_autograd(_grads, setup_context=_setup_context)


class _EagerDifferentialThresholdAttention(torch.autograd.Function):
    """The same forward and backward for eager calls, without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, *inputs) -> torch.Tensor:  # not setup_context: Function.apply would inspect.signature
        *inputs, prepared = inputs  # prepared: a call plan's forward (None: the launcher's path)
        out = _forward(*inputs) if prepared is None else prepared(*inputs[:7])
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        return *_grads(ctx, dout, _backward), None


def differential_threshold_attention_apply(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    power: float,
    scale: float,
    backend: str,
    prepared: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The op on checked inputs: the custom op while tracing (torch.compile, export, fake tensors), else the
    same code as an autograd.Function, or with no gradient to record (function.records_nothing) the forward
    alone. For the Triton kernels (one set of strides per q or k pair) a pair
    with different layouts is made to share one here, once, by copying one of the two: forward and backward
    then read the same tensors (gradients reach the copied input through the copy). prepared: the forward a
    call plan prepared for these inputs (triton_differential.PreparedDiffForward, only for pairs whose strides
    match), launched in place of the launcher's path."""
    if backend == "triton" and prepared is None:
        from lit_thresh.ops.triton_differential import match_strides

        q1, q2 = match_strides(q1, q2)
        k1, k2 = match_strides(k1, k2)
    if type(q1) is torch.Tensor and not torch.compiler.is_compiling():
        if records_nothing(q1, q2, k1, k2, v, beta, lam):  # no autograd node
            if prepared is not None:
                return prepared(q1, q2, k1, k2, v, beta, lam)
            return _forward(q1, q2, k1, k2, v, beta, lam, power, scale, backend)
        return _EagerDifferentialThresholdAttention.apply(q1, q2, k1, k2, v, beta, lam, power, scale, backend,
                                                          prepared)
    return differential_threshold_attention_op(q1, q2, k1, k2, v, beta, lam, power, scale, backend)
