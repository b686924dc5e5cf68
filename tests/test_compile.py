"""torch.compile of a Transformer with threshold attention: one graph, no graph break, no recompile."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from lit_thresh.attention import ThresholdAttention
from lit_thresh.model import Transformer, TransformerConfig

VOCAB = 17


def _model(device: str = "cpu") -> Transformer:
    torch.manual_seed(0)
    attention = functools.partial(ThresholdAttention, beta=0.3, power=2.0, qk_norm=True)
    config = TransformerConfig(VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention, max_seq_len=32)
    return Transformer(config).to(device)


def _batch(step: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(step)).to(device)


def _train_step(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def test_compile_fullgraph_no_recompile(monkeypatch):
    """CPU, the blockwise PyTorch backend, aot_eager: one frame compiled for two training steps."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    eager, model = _model(), _model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # fullgraph: a graph break raises
    for step in range(2):
        loss = _train_step(compiled, _batch(step))
        torch.testing.assert_close(loss, _train_step(eager, _batch(step)))
    assert counter.frame_count == 1  # the second step, new data of the same shape, reused the graph
    ops = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.lit_thresh.threshold_attention.default) == 2  # one opaque node per layer
    for p, p_eager in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, p_eager.grad)
    beta = model.blocks[0].attn.threshold.beta
    assert beta.grad is not None and beta.grad.abs().sum() > 0  # beta learns through the compiled op


@pytest.mark.gpu
def test_compile_reduce_overhead_triton_cuda():
    """CUDA, the Triton backend, CUDA graphs: no graph break, no recompile over 3 steps, loss as eager."""
    torch._dynamo.reset()
    counters.clear()
    eager, model = _model("cuda"), _model("cuda")
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for step in range(3):
        # as an optimizer loop does: the last step's gradients are CUDA-graph outputs that the next replay
        # overwrites, so they must not be accumulated into
        compiled.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _train_step(compiled, _batch(step, "cuda"))
            loss_eager = _train_step(eager, _batch(step, "cuda"))
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, loss_eager, rtol=2e-2, atol=2e-2)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
