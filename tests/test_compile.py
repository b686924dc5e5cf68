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


def _model(device: str = "cpu", beta: float = 0.3, skip_zero: bool = False, max_seq_len: int = 32) -> Transformer:
    torch.manual_seed(0)
    attention = functools.partial(ThresholdAttention, beta=beta, power=2.0, qk_norm=True, skip_zero=skip_zero)
    config = TransformerConfig(VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention,
                               max_seq_len=max_seq_len)
    return Transformer(config).to(device)


def _batch(step: int, device: str = "cpu", length: int = 17) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(step)).to(device)


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


def _steps_in_cuda_graphs(skip_zero: bool, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Per training step (no optimizer step) of the model compiled with CUDA graphs (reduce-overhead, bf16
    autocast; beta 0.8, T = 199: at step 0, 56-69% of the 64 x 64 tiles below the diagonal are all zero): the
    loss and every parameter's gradient. One graph, no graph break."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("cuda", beta=0.8, skip_zero=skip_zero, max_seq_len=256)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    steps_out = []
    for step in range(steps):
        compiled.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _train_step(compiled, _batch(step, "cuda", 200))
        # cloned: the next replay overwrites the graph's outputs
        steps_out.append({"loss": loss.clone()} | {name: p.grad.clone() for name, p in model.named_parameters()})
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    return steps_out


@pytest.mark.gpu
def test_skip_zero_inside_cuda_graphs_gives_the_same_loss_and_gradients(monkeypatch):
    """skip_zero with the op's tile map and work lists made and read inside the replayed CUDA graphs: the op's
    results are the same bit for bit, so three steps' loss and gradients agree with skip_zero off up to the
    order of atomic adds (the embedding's backward): relative error norms below 1e-5. The work lists are built
    (while the graphs are recorded) with skip_zero only, so the skipping path is the one that ran."""
    from lit_thresh.ops import triton_launch

    built = []

    def counted(*args, **kwargs):
        built.append(kwargs.get("by_key"))
        return tile_lists(*args, **kwargs)

    tile_lists = triton_launch.tile_lists
    monkeypatch.setattr(triton_launch, "tile_lists", counted)
    off = _steps_in_cuda_graphs(False)
    assert not built
    on = _steps_in_cuda_graphs(True)
    assert built and set(built) == {True, False}  # the dK/dV and the dQ kernels' lists
    for step, (a, b) in enumerate(zip(off, on, strict=True)):
        for name, x in a.items():
            error = (x.float() - b[name].float()).norm() / x.float().norm().clamp_min(1e-12)
            assert error < 1e-5, f"step {step}, {name}: relative error {error:.3g}"
