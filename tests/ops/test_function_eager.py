"""The eager call paths (function.threshold_attention_apply, differential_function's apply): an autograd
node only when a gradient can be asked for, the forward alone otherwise, with the same result; forward-mode
AD is refused as before."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from lit_thresh.ops import differential_function, differential_threshold_attention, function, threshold_attention
from lit_thresh.ops.reference import threshold_attention_reference
from tests.ops.helpers import TOLERANCE, generator, randn, rel_err


def _inputs(requires_grad: bool):
    gen = generator("eager", requires_grad)
    q, k, v = (randn(gen, 1, 2, 40, 16).requires_grad_(requires_grad) for _ in range(3))
    return q, k, v, randn(gen, 2, scale=0.3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_grad_calls_record_no_node_and_give_the_same_output(backend):
    q, k, v, beta = _inputs(True)
    with_graph = threshold_attention(q, k, v, beta, 2.0, backend=backend)
    with torch.no_grad():
        no_grad = threshold_attention(q, k, v, beta, 2.0, backend=backend)
    detached = threshold_attention(q.detach(), k.detach(), v.detach(), beta, 2.0, backend=backend)
    assert with_graph.grad_fn is not None
    assert no_grad.grad_fn is None and detached.grad_fn is None and not detached.requires_grad
    torch.testing.assert_close(no_grad, with_graph.detach(), rtol=0, atol=0)
    torch.testing.assert_close(detached, with_graph.detach(), rtol=0, atol=0)
    ref = threshold_attention_reference(q.double(), k.double(), v.double(), beta.double(), 2.0)
    assert rel_err(detached, ref) < TOLERANCE[torch.float32]


def test_a_beta_that_requires_grad_alone_gets_its_gradient():
    q, k, v, beta = _inputs(False)
    beta.requires_grad_()
    (dbeta,) = torch.autograd.grad(threshold_attention(q, k, v, beta, 2.0).sum(), beta)
    beta64 = beta.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(threshold_attention_reference(q.double(), k.double(), v.double(), beta64, 2.0).sum(), beta64)
    assert rel_err(dbeta, ref) < TOLERANCE[torch.float32]


def test_forward_mode_tangents_are_refused_not_dropped():
    """With no input requiring grad, a forward-mode tangent still goes through the autograd.Function,
    which has no jvp: an error, not an output that silently lost its tangent."""
    q, k, v, beta = _inputs(False)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            threshold_attention(dual, k, v, beta, 2.0)


def _diff_inputs(requires_grad: bool):
    gen = generator("eager-diff", requires_grad)
    q1, q2, k1, k2, v = (randn(gen, 1, 2, 40, 16).requires_grad_(requires_grad) for _ in range(5))
    return q1, q2, k1, k2, v, randn(gen, 2, scale=0.3), randn(gen, 2, scale=0.5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_differential_no_grad_calls_record_no_node_and_give_the_same_output(backend):
    *qkv, beta, lam = _diff_inputs(True)
    with_graph = differential_threshold_attention(*qkv, beta, lam, 2.0, backend=backend)
    with torch.no_grad():
        no_grad = differential_threshold_attention(*qkv, beta, lam, 2.0, backend=backend)
    detached = differential_threshold_attention(*(t.detach() for t in qkv), beta, lam, 2.0, backend=backend)
    assert with_graph.grad_fn is not None
    assert no_grad.grad_fn is None and detached.grad_fn is None and not detached.requires_grad
    torch.testing.assert_close(no_grad, with_graph.detach(), rtol=0, atol=0)
    torch.testing.assert_close(detached, with_graph.detach(), rtol=0, atol=0)
    q1, q2, k1, k2, v = (t.detach().double() for t in qkv)
    ref = threshold_attention_reference(q1, k1, v, beta.double(), 2.0) - lam.double().reshape(-1, 1, 1) * (
        threshold_attention_reference(q2, k2, v, beta.double(), 2.0))
    assert rel_err(detached, ref) < TOLERANCE[torch.float32]


def test_differential_lambda_that_requires_grad_alone_gets_its_gradient_and_tangents_are_refused():
    *qkv, beta, lam = _diff_inputs(False)
    lam.requires_grad_()
    (dlam,) = torch.autograd.grad(differential_threshold_attention(*qkv, beta, lam, 2.0).sum(), lam)
    lam64 = lam.detach().double().requires_grad_()
    q1, q2, k1, k2, v = (t.double() for t in qkv)
    ref = threshold_attention_reference(q1, k1, v, beta.double(), 2.0) - lam64.reshape(-1, 1, 1) * (
        threshold_attention_reference(q2, k2, v, beta.double(), 2.0))
    (want,) = torch.autograd.grad(ref.sum(), lam64)
    assert rel_err(dlam, want) < TOLERANCE[torch.float32]
    with fwAD.dual_level():
        dual = fwAD.make_dual(qkv[0], torch.ones_like(qkv[0]))
        with pytest.raises(NotImplementedError, match="jvp"):
            differential_threshold_attention(dual, *qkv[1:], beta, lam.detach(), 2.0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("differential", [False, True])
def test_calls_with_nothing_to_record_skip_the_autograd_function(monkeypatch, differential, backend):
    """No grad mode or no input requiring grad: the forward alone, never the autograd.Function (with
    triton, also after the differential op matched a q pair's strides)."""
    module, name = (differential_function, "_EagerDifferentialThresholdAttention") if differential else (
        function, "_EagerThresholdAttention")

    def refuse(*args):
        raise AssertionError("the autograd.Function ran for a call with nothing to record")

    monkeypatch.setattr(getattr(module, name), "apply", refuse)
    op = differential_threshold_attention if differential else threshold_attention
    inputs = _diff_inputs(False) if differential else _inputs(False)
    if differential:  # q2 in another layout than q1: the triton path copies it into q1's
        inputs = (inputs[0], inputs[1].transpose(-1, -2).contiguous().transpose(-1, -2), *inputs[2:])
    assert op(*inputs, 2.0, backend=backend).grad_fn is None
    with torch.no_grad():
        assert op(*inputs, 2.0, backend=backend).grad_fn is None


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_eager_backward_makes_no_beta_gradient_where_none_is_asked(backend):
    """The eager path's backward returns None for beta where beta needs no gradient (the custom op's returns
    zeros, as its schema asks); q, k and v get theirs either way."""
    q, k, v, beta = _inputs(False)
    dout = torch.randn_like(q)
    skipped = function._eager_backward(dout, q, k, v, beta, 2.0, 1.0, backend, False)
    full = function._eager_backward(dout, q, k, v, beta, 2.0, 1.0, backend, True)
    assert skipped[3] is None and full[3].shape == beta.shape
    for a, b in zip(skipped[:3], full[:3]):
        assert torch.equal(a, b)
    assert torch.equal(function._backward(dout, q, k, v, beta, 2.0, 1.0, backend, False)[3], torch.zeros_like(beta))
