"""differential_threshold_rela_triton against the float64 reference, gradients to every input and to lambda."""

from __future__ import annotations

import pytest
import torch

from lit_thresh.ops import differential_threshold_attention_reference, differential_threshold_rela_triton
from tests.ops.helpers import TOLERANCE, generator, randn, rel_err

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("lam", ["scalar", "per_head", "clamped", 0.3])
def test_differential_matches_reference(device, dtype, normalize, lam):
    gen = generator("diff", device, dtype, normalize, lam)
    b, hq, hkv, tq, tk, d = 2, 4, 2, 29, 41, 48
    q1, q2 = (randn(gen, b, hq, tq, d, dtype=dtype, device=device).requires_grad_() for _ in range(2))
    k1, k2 = (randn(gen, b, hkv, tk, d, dtype=dtype, device=device).requires_grad_() for _ in range(2))
    v = randn(gen, b, hkv, tk, d, dtype=dtype, device=device).requires_grad_()
    beta = randn(gen, hq, device=device, scale=0.5).requires_grad_()
    lam = {
        "scalar": lambda: torch.tensor(0.6, device=device),
        "per_head": lambda: torch.rand(hq, generator=gen).to(device),
        "clamped": lambda: torch.tensor([1.4, 0.5, -0.2, 0.9], device=device),  # outside [0, 1]: clamped
    }.get(lam, lambda: lam)()
    if isinstance(lam, torch.Tensor):
        lam.requires_grad_()
    inputs = [q1, q2, k1, k2, v, beta] + ([lam] if isinstance(lam, torch.Tensor) else [])

    out = differential_threshold_rela_triton(q1, q2, k1, k2, v, beta, lam, relu_power=2.0, normalize=normalize)
    dout = randn(gen, *out.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(out, inputs, dout)

    ref_inputs = [t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    ref = differential_threshold_attention_reference(*ref_inputs[:6], ref_inputs[6] if len(ref_inputs) > 6 else lam,
                                                     power=2.0, normalize=normalize)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())

    tol = TOLERANCE[dtype]
    assert rel_err(out, ref) < tol
    for name, g, r in zip(("dq1", "dq2", "dk1", "dk2", "dv", "dbeta"), grads, ref_grads):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < tol, (name, rel_err(g, r))
    if isinstance(lam, torch.Tensor):
        # dlambda = -sum(dout * A2V) over (B, T, Dv) and heads: a long reduction whose terms cancel, so
        # it is bounded against sum |dout * A2V| (the reduction's condition) rather than its own norm.
        a2v = differential_threshold_attention_reference(*ref_inputs[:6], 0.0, normalize=normalize) - \
            differential_threshold_attention_reference(*ref_inputs[:6], 1.0, normalize=normalize)
        terms = (dout.double() * a2v.detach()).abs()
        magnitude = terms.sum((0, 2, 3)) if lam.numel() > 1 else terms.sum()
        assert grads[-1].shape == lam.shape
        assert torch.all((grads[-1].double() - ref_grads[-1]).abs().cpu() <= tol * magnitude.cpu())
    if isinstance(lam, torch.Tensor) and lam.numel() == hq and (lam.detach() > 1).any():
        outside = ((lam.detach() < 0) | (lam.detach() > 1)).cpu()
        assert torch.all(grads[-1].cpu()[outside] == 0)  # clamp: no gradient outside [0, 1]
