"""skip_zero on a trained threshold model's own attention maps: does it pay on this model?

    python -m lit_thresh.trained_maps \\
        --run_config RUN/config.yaml --ckpt_path RUN/checkpoints/best.ckpt [--rounds 3] [--csv_path maps.csv] \\
        [--batch_size 32] [--cuda_graphs true]

The run's saved config rebuilds the model and its DataModule (as lit_thresh.generate); the checkpoint gives the
weights. The first validation batch runs through the model in eval mode (bf16 autocast on a GPU), and each
ThresholdAttention layer's op inputs (q, k, v, beta, power, scale, after qk_norm and the learned scale) are
recorded. Per layer: the fraction of exact zeros among the causal weights, the fraction of all-zero 64 x 64
tiles below the diagonal (lit_thresh.diagnostics), whether skip_zero on and off give the same output and
gradients bit for bit, and on CUDA the op's forward+backward time with skip_zero off and on (the median of
`rounds` interleaved `triton.testing.do_bench` calls, and their spread, (max - min) / median). The calls are
eager, so at small sizes host time is part of what is timed (lit_thresh/ops/PERF.md v13); `--cuda_graphs true`
times replays of CUDA graphs instead, and `--batch_size` takes a larger batch. Bad input ends with one line,
``lit_thresh.trained_maps: error: <message>``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from jsonargparse import auto_cli
from torch import nn

from lit_thresh.attention.threshold import ThresholdAttention, ThresholdMap
from lit_thresh.bench import median_spread
from lit_thresh.cli_errors import Parser, exit_on_input_error
from lit_thresh.diagnostics import zero_fraction, zero_tile_fraction
from lit_thresh.generate import load_run
from lit_thresh.ops import threshold_attention
from lit_thresh.ops.reference import threshold_attention_weights

PROG = "lit_thresh.trained_maps"


@dataclass
class OpInputs:
    """One layer's threshold_attention call: q (B, H, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv), beta (H,)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    power: float
    scale: float


@dataclass
class LayerResult:
    """A layer's map statistics and, on CUDA, its forward+backward ms with skip_zero off and on (NaN: not timed)."""

    layer: int
    shape: tuple[int, ...] = field(default=())
    zero_frac: float = math.nan
    zero_tile_frac: float = math.nan
    same: bool = False
    off_ms: float = math.nan
    on_ms: float = math.nan
    off_spread: float = math.nan
    on_spread: float = math.nan


def capture_op_inputs(model: nn.Module, idx: torch.Tensor) -> list[OpInputs]:
    """Runs model(idx) without gradients and returns the op inputs of its ThresholdAttention layers, in call
    order, as the op receives them (cast to the autocast dtype when autocast is on)."""
    maps = [m.threshold for m in model.modules() if isinstance(m, ThresholdAttention)]
    if not maps:
        raise ValueError("the model has no ThresholdAttention layer: skip_zero is an option of threshold attention only")
    captured: list[OpInputs] = []

    def record(module: ThresholdMap, args: tuple) -> None:
        q, k = module.prepare(args[0], args[1])
        v = args[2]
        if torch.is_autocast_enabled(q.device.type):
            q, k, v = (t.to(torch.get_autocast_dtype(q.device.type)) for t in (q, k, v))
        captured.append(OpInputs(q.detach().clone(), k.detach().clone(), v.detach().clone(),
                                 module.beta.detach().float().clone(), module.power, module.scale))

    handles = [m.register_forward_pre_hook(record) for m in maps]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _step(inputs: OpInputs, dout: torch.Tensor, skip_zero: bool) -> Callable[[], list[torch.Tensor]]:
    """A forward+backward of the layer's op on leaves made once: each call returns [out, dq, dk, dv, dbeta]."""
    leaves = [t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v, inputs.beta)]

    def run() -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        out = threshold_attention(*leaves, inputs.power, scale=inputs.scale, skip_zero=skip_zero)
        out.backward(dout)
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    return run


def measure_layer(layer: int, inputs: OpInputs, rounds: int = 3,
                  bench: Callable[[Callable[[], object]], float] | None = None) -> LayerResult:
    """The layer's map statistics and skip_zero agreement; with `bench` (ms of a callable, e.g. do_bench),
    also the forward+backward time with skip_zero off and on, `rounds` interleaved rounds."""
    weights = threshold_attention_weights(inputs.q.float(), inputs.k.float(), inputs.beta, inputs.power,
                                          inputs.scale)  # (B, H, T, T)
    tiles = zero_tile_fraction(weights)
    result = LayerResult(layer, tuple(inputs.q.shape), zero_fraction(weights).mean().item(),
                         math.nan if tiles is None else tiles.mean().item())
    gen = torch.Generator(inputs.q.device).manual_seed(layer)
    dout = torch.randn(inputs.q.shape[:3] + inputs.v.shape[3:], generator=gen, device=inputs.q.device,
                       dtype=inputs.q.dtype)  # (B, H, T, Dv)
    steps = {skip: _step(inputs, dout, skip) for skip in (False, True)}
    result.same = all(torch.equal(a, b) for a, b in zip(steps[False](), steps[True](), strict=True))
    if bench is None:
        return result
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for skip in (False, True):
            times[skip].append(bench(steps[skip]))
    result.off_ms, result.off_spread = median_spread(times[False])
    result.on_ms, result.on_spread = median_spread(times[True])
    return result


def op_timer(cuda_graphs: bool, rep: int = 100) -> Callable[[Callable[[], object]], float]:
    """The ms of one call of a callable on CUDA, over about `rep` ms of calls: the median replay of a CUDA graph
    of it (`triton.testing.do_bench_cudagraph`), or `do_bench`'s median of eager calls after rep / 4 ms of
    warm-up."""
    from triton.testing import do_bench, do_bench_cudagraph

    def bench(fn: Callable[[], object]) -> float:
        if cuda_graphs:
            return do_bench_cudagraph(fn, rep=rep, return_mode="median")
        return do_bench(fn, warmup=rep // 4, rep=rep)

    return bench


def _spread(spread: float) -> str:
    return "" if math.isnan(spread) else f" ({spread:.1%})"


def format_table(results: list[LayerResult]) -> str:
    """A Markdown table, a row per layer."""
    lines = ["| layer | shape (B, H, T, D) | zero weights | all-zero 64x64 tiles | skip off ms | skip on ms | "
             "off / on | same bit for bit |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        timed = not math.isnan(r.off_ms)
        times = (f"{r.off_ms:.4f}{_spread(r.off_spread)} | {r.on_ms:.4f}{_spread(r.on_spread)} | "
                 f"{r.off_ms / r.on_ms:.2f}x" if timed else "- | - | -")
        lines.append(f"| {r.layer} | {r.shape} | {r.zero_frac:.4f} | {r.zero_tile_frac:.3f} | {times} | "
                     f"{'yes' if r.same else 'NO'} |")
    return "\n".join(lines)


def write_csv(path: Path, results: list[LayerResult]) -> None:
    with Path(path).open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def trained_maps(run_config: Path, ckpt_path: Path, rounds: int = 3, csv_path: Path | None = None,
                 batch_size: int | None = None, cuda_graphs: bool = False) -> list[LayerResult]:
    """Prints and returns, per ThresholdAttention layer of a trained run, its map statistics and skip_zero's
    effect on the op's forward+backward time (timed on CUDA only).

    Args:
        run_config: the config.yaml a `lit_thresh fit` run saved (model and data settings).
        ckpt_path: one of that run's checkpoints (e.g. its best).
        rounds: interleaved timing rounds per layer and setting (>= 1): medians and spreads over them.
        csv_path: also write the rows as CSV.
        batch_size: the validation batch's size (default: the run's); larger batches time the kernels
            rather than the host.
        cuda_graphs: time each forward+backward replayed from a CUDA graph
            (`triton.testing.do_bench_cudagraph`), as training with `compile: reduce-overhead` runs it: without
            the host's time per call (and without the L2 flush that eager `do_bench` does before each call).
            The bit-for-bit comparison runs on eager calls either way.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    overrides = ["--model.compile=false",
                 *([] if batch_size is None else [f"--data.init_args.batch_size={batch_size}"])]
    module, data = load_run(run_config, ckpt_path, *overrides)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = module.model.to(device).eval()
    data.setup("validate")
    idx = next(iter(data.val_dataloader()))["input_ids"].to(device)  # (B, T)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
        captured = capture_op_inputs(model, idx)
    bench = op_timer(cuda_graphs) if cuda else None
    results = [measure_layer(i, inputs, rounds, bench) for i, inputs in enumerate(captured)]
    print(format_table(results))
    if cuda:
        print(f"(forward+backward of each layer's op, {'replayed CUDA graphs' if cuda_graphs else 'eager calls'})")
    else:
        print("(no CUDA device: statistics only, not timed)")
    if csv_path is not None:
        write_csv(csv_path, results)
    return results


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m lit_thresh.trained_maps``."""
    with exit_on_input_error(PROG):
        auto_cli(trained_maps, args=args, as_positional=False, parser_class=Parser, prog=f"python -m {PROG}",
                 description=__doc__)


if __name__ == "__main__":
    main()
