"""threshold_attention as a torch.library op: opcheck, fake tensors, torch.export."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_thresh.attention import ThresholdAttention
from lit_thresh.model import Transformer, TransformerConfig
from lit_thresh.ops import threshold_attention
from lit_thresh.ops.function import threshold_attention_backward_op, threshold_attention_op
from tests.ops.helpers import generator, randn


def _op_args(backend: str, dtype=torch.float32, layout: str = "bhtd", hq=4, hkv=2, tq=5, tk=9, d=16, dv=8):
    gen = generator("library", backend, dtype, layout, hq, hkv, tq, tk, d, dv)

    def make(h, t, dim):
        if layout == "bthd":  # a (B, T, H, D) tensor seen as (B, H, T, D)
            return randn(gen, 2, t, h, dim, dtype=dtype).transpose(1, 2).requires_grad_()
        return randn(gen, 2, h, t, dim, dtype=dtype).requires_grad_()

    beta_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    beta = randn(gen, hq, dtype=beta_dtype, scale=0.5).requires_grad_()
    return make(hq, tq, d), make(hkv, tk, d), make(hkv, tk, dv), beta, 2.0, 1.0, backend


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck_torch_backend(dtype, layout):
    args = _op_args("torch", dtype, layout)
    torch.library.opcheck(threshold_attention_op, args)
    dout = torch.randn(2, 4, 5, 8, dtype=dtype)
    torch.library.opcheck(threshold_attention_backward_op, (dout, *(a.detach() for a in args[:4]), 1.5, 0.5, "torch", True))


def test_opcheck_torch_backend_empty_batch():
    q, k, v, beta, *rest = _op_args("torch")
    torch.library.opcheck(threshold_attention_op, (q[:0], k[:0], v[:0], beta, *rest))


@pytest.mark.parametrize("layout,skip_zero", [("bhtd", False), ("bthd", False), ("bhtd", True)])
def test_opcheck_triton_backend(layout, skip_zero):
    """Under TRITON_INTERPRET=1 on CPU (tests/conftest.py), else on CUDA tensors; skip_zero: the op's last
    argument."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, beta, *rest = _op_args("triton", layout=layout, hq=2, hkv=1, tq=3, tk=4, d=16, dv=16)
    q, k, v, beta = (t.detach().to(device).requires_grad_() for t in (q, k, v, beta))
    torch.library.opcheck(threshold_attention_op, (q, k, v, beta, *rest, skip_zero))


@pytest.mark.gpu
def test_opcheck_with_skip_zero_at_the_default_fp16_tiles():
    """The op's fake map has the real map's shape where the forward's tiles (128x64 at fp16, D = 128)
    differ from the backward kernels' and the sizes are not multiples of them."""
    q, k, v, beta, *rest = _op_args("triton", torch.float16, hq=2, hkv=1, tq=200, tk=200, d=128, dv=128)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(threshold_attention_op, (q, k, v, beta.detach().cuda().requires_grad_(), *rest, True))


def test_a_call_with_no_gradient_to_record_asks_the_op_for_no_map(monkeypatch):
    """On the op's path (tracing, fake tensors) as on the eager one, skip_zero only makes the forward write
    its map when a backward can follow."""
    from lit_thresh.ops import function

    calls = []
    real = function.threshold_attention_op
    monkeypatch.setattr(function, "threshold_attention_op", lambda *args: calls.append(args[-1]) or real(*args))
    with FakeTensorMode():
        q = torch.empty(1, 2, 64, 16)
        leaf = torch.empty(1, 2, 64, 16, requires_grad=True)
        with torch.no_grad():
            function.threshold_attention_apply(leaf, q, q, torch.ones(2), 2.0, 1.0, "triton", True)
        function.threshold_attention_apply(q, q, q, torch.ones(2), 2.0, 1.0, "triton", True)
        function.threshold_attention_apply(leaf, q, q, torch.ones(2), 2.0, 1.0, "triton", True)
    assert calls == [False, False, True]


def test_fake_tensors_give_shapes_and_dtypes_without_computing():
    with FakeTensorMode():
        q = torch.empty(2, 4, 5, 16, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 9, 16, dtype=torch.bfloat16)
        v = torch.empty(2, 2, 9, 24, dtype=torch.bfloat16)
        out = threshold_attention(q, k, v, torch.zeros(4), 1.5, backend="torch")
    assert out.shape == (2, 4, 5, 24) and out.dtype == torch.bfloat16


def _tiny_threshold_model() -> Transformer:
    torch.manual_seed(0)
    attention = functools.partial(ThresholdAttention, beta=0.3, power=2.0)
    config = TransformerConfig(13, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention, max_seq_len=16)
    return Transformer(config)


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["torch", "triton"])
def test_export_of_a_threshold_model(monkeypatch, interpret):
    """torch.export traces the op as one node, and the exported program computes what eager does."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)  # 'auto' picks the backend per call
    model = _tiny_threshold_model()
    idx = torch.randint(0, 13, (2, 10), generator=torch.Generator().manual_seed(3))
    exported = torch.export.export(model, (idx,))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.lit_thresh.threshold_attention.default) == 2  # one per layer
    torch.testing.assert_close(exported.module()(idx), model(idx))


def test_eager_path_and_custom_op_agree():
    """Eager calls skip the op's dispatch (an autograd.Function on the same code): same values and grads."""
    from lit_thresh.ops.function import threshold_attention_apply

    args = _op_args("torch", layout="bthd")
    outs = [threshold_attention_apply(*args), threshold_attention_op(*args)[0]]
    dout = randn(generator("agree"), *outs[0].shape)
    grads = [torch.autograd.grad(out, args[:4], dout) for out in outs]
    assert torch.equal(outs[0], outs[1]) and outs[0].stride() == outs[1].stride()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
