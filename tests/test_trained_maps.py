"""`python -m lit_thresh.trained_maps`: a trained threshold model's op inputs, map statistics and skip_zero timing."""

import csv
import functools
import math
import os
import subprocess
import sys

import pytest
import torch

from lit_thresh.attention import SoftmaxAttention, ThresholdAttention
from lit_thresh.attention.threshold import ThresholdMap
from lit_thresh.model import Transformer, TransformerConfig
from lit_thresh.ops import threshold_attention
from lit_thresh.trained_maps import LayerResult, capture_op_inputs, format_table, measure_layer, op_timer, write_csv
from lit_thresh.trained_maps import main as trained_maps_main
from tests.tiny_runs import fit_tiny_text_run

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


def _model(attention=ThresholdAttention, **kwargs) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(41, 32, 2, 2, attention=functools.partial(attention, **kwargs), max_seq_len=80)
    return Transformer(config).eval()


def test_capture_gives_each_layer_the_inputs_its_op_received():
    """With qk_norm and a learned score scale, the recorded (q, k, v, beta, power, scale) reproduce each layer's
    map applied to v exactly, layer by layer, in call order."""
    model = _model(qk_norm=True, learn_scale=True, beta=0.5, power=3.0, scale=4.0)
    outputs = []
    maps = [m for m in model.modules() if isinstance(m, ThresholdMap)]
    handles = [m.register_forward_hook(lambda module, args, out: outputs.append(out)) for m in maps]
    idx = torch.randint(0, 41, (2, 80))
    captured = capture_op_inputs(model, idx)
    for handle in handles:
        handle.remove()
    assert len(captured) == len(maps) == len(outputs) == 2
    for inputs, out in zip(captured, outputs, strict=True):
        assert inputs.power == 3.0 and inputs.scale == 1.0  # a learned scale multiplies q; the op's is 1
        assert torch.allclose(inputs.q.norm(dim=-1), torch.full(inputs.q.shape[:3], 4.0), atol=1e-4)  # g = 4
        assert torch.equal(threshold_attention(inputs.q, inputs.k, inputs.v, inputs.beta, inputs.power,
                                               scale=inputs.scale), out)
    assert not any(m._forward_pre_hooks for m in maps), "the capture removes its hooks"


def test_a_model_without_threshold_attention_is_refused():
    with pytest.raises(ValueError, match="no ThresholdAttention layer"):
        capture_op_inputs(_model(SoftmaxAttention), torch.randint(0, 41, (1, 8)))


def test_measure_layer_statistics_agreement_and_interleaved_timing(tmp_path):
    """A sparse layer (high beta): statistics in range, skip on and off agree bit for bit; the timing loop runs
    both settings `rounds` times, interleaved, and reports medians and spreads."""
    model = _model(qk_norm=True, beta=3.0)
    inputs = capture_op_inputs(model, torch.randint(0, 41, (2, 80)))[0]
    calls = []

    def bench(fn):
        if not calls:  # the callable runs a step (once: each costs the interpreter seconds)
            assert len(fn()) == 5
        calls.append(len(calls))
        return [1.0, 2.0, 4.0, 3.0, 1.0, 2.0][len(calls) - 1]

    result = measure_layer(0, inputs, rounds=3, bench=bench)
    assert result.same and 0.5 < result.zero_frac <= 1.0 and 0.0 <= result.zero_tile_frac <= 1.0
    assert len(calls) == 6
    assert (result.off_ms, result.on_ms) == (1.0, 2.0)  # off: 1, 4, 1; on: 2, 3, 2
    assert result.off_spread == 3.0 and math.isclose(result.on_spread, 1 / 2)
    untimed = LayerResult(1, (2, 2, 80, 16), 0.9, 0.5, True)  # measure_layer without bench: the command's test
    table = format_table([result, untimed])
    assert table.count("\n") == 3 and "0.50x" in table and "| - | - | - |" in table
    write_csv(tmp_path / "maps.csv", [result, untimed])
    rows = list(csv.DictReader((tmp_path / "maps.csv").open()))
    assert [row["layer"] for row in rows] == ["0", "1"] and rows[0]["on_ms"] == "2.0"


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_measure_layer_times_both_settings_on_a_gpu(cuda_graphs):
    """The command's timer, eager and replaying CUDA graphs (the skip_zero map and lists made inside the graph),
    times both settings."""
    model = _model(qk_norm=True, beta=3.0).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        inputs = capture_op_inputs(model, torch.randint(0, 41, (4, 80), device="cuda"))[0]
    assert inputs.q.dtype == torch.bfloat16
    result = measure_layer(0, inputs, rounds=2, bench=op_timer(cuda_graphs, rep=10))
    assert result.same and result.off_ms > 0 and result.on_ms > 0


@pytest.mark.slow
def test_the_command_on_a_tiny_trained_run(tmp_path, monkeypatch):
    run = fit_tiny_text_run(tmp_path, monkeypatch, "--data.block_size=80", "--data.batch_size=2",
                            "--data.val_samples=4", "--model.config.n_layers=2",
                            "--model.config.attention.init_args.qk_norm=true")
    ckpt = run / "checkpoints" / "last.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "lit_thresh.trained_maps", f"--run_config={run / 'config.yaml'}", f"--ckpt_path={ckpt}",
         "--csv_path=maps.csv", "--batch_size=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows)
    assert "(3, 2, 80, 12)" in rows[0] and "no CUDA device" in result.stdout
    assert len(list(csv.DictReader((tmp_path / "maps.csv").open()))) == 2

    def error(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            trained_maps_main([f"--run_config={run / 'config.yaml'}", *args])
        message = str(exit_info.value.code)
        assert message.startswith("lit_thresh.trained_maps: error: ") and "\n" not in message
        return message

    assert "rounds must be >= 1, got 0" in error(f"--ckpt_path={ckpt}", "--rounds=0")
    assert "batch_size must be an int >= 1, got 0" in error(f"--ckpt_path={ckpt}", "--batch_size=0")
    assert "no such checkpoint file" in error("--ckpt_path=missing.ckpt")
