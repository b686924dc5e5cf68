"""Where a training step's GPU time goes, and how long a step takes.

Add the callback to any run; it profiles `steps` training steps after `start` and logs the GPU time per
step of attention forward kernels, attention backward kernels and everything else (``profile/*_ms``):

    lit_thresh fit --config configs/text/shakespeare_char_threshold.yaml \\
        --trainer.callbacks+=lit_thresh.profile.KernelBreakdown

Then summarise runs from their TensorBoard events: ms/step as the median (and the spread) of the
``train/device/batches_per_sec`` windows, best val/loss and the breakdown:

    python -m lit_thresh.profile lightning_logs/shakespeare_char_*/version_0
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

# GPU kernel names by part of the step: our Triton kernels and PyTorch SDPA's (flash, cuDNN, efficient).
ATTENTION_FORWARD = re.compile(r"threshold_fwd|differential\w*fwd|flash_fwd|fmha\w*F|fprop|attention_fwd", re.I)
ATTENTION_BACKWARD = re.compile(r"threshold_bwd|differential\w*bwd|flash_bwd|fmha\w*B|dgrad|bprop|attention_bwd", re.I)
PARTS = ("attention_forward", "attention_backward", "rest")


def kernel_part(name: str) -> str:
    """Which part of the step a GPU kernel belongs to: one of PARTS."""
    if ATTENTION_BACKWARD.search(name):
        return "attention_backward"
    if ATTENTION_FORWARD.search(name):
        return "attention_forward"
    return "rest"


class KernelBreakdown(Callback):
    """Profiles training steps [start, start + steps) with torch.profiler and logs the GPU time per step of
    each part (PARTS), in ms, as ``profile/<part>_ms`` and ``profile/gpu_ms``; ``top`` > 0 also prints the
    `top` kernels by GPU time. Only on CUDA; rank 0 prints."""

    def __init__(self, start: int = 200, steps: int = 20, top: int = 0) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"start must be an int >= 1 (after compilation and warm-up), got {start!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"top must be an int >= 0, got {top!r}")
        self.start, self.steps, self.top = start, steps, top
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_step == self.start and self._profiler is None and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int) -> None:
        if self._profiler is None or trainer.global_step < self.start + self.steps:
            return
        torch.cuda.synchronize(pl_module.device)
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        ms = breakdown(profiler.events(), self.steps)
        pl_module.log_dict({f"profile/{part}_ms": value for part, value in ms.items()}, rank_zero_only=True)
        rank_zero_info("GPU ms per step: " + ", ".join(f"{part} {value:.3f}" for part, value in ms.items()))
        if self.top:
            rank_zero_info(profiler.key_averages().table(sort_by="device_time_total", row_limit=self.top))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._profiler is not None:  # training ended inside the window: drop it
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def breakdown(events: Sequence, steps: int) -> dict[str, float]:
    """GPU kernel time per step (ms) of each part of PARTS, and their sum as ``gpu``. GPU-side ranges of
    ``record_function`` annotations (the optimizer step, a compiled graph's call) span kernels and are skipped."""
    total = dict.fromkeys(PARTS, 0.0)
    for event in events:
        kernel = event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation
        if kernel and event.device_time_total > 0:
            total[kernel_part(event.name)] += event.device_time_total / 1000.0  # us -> ms
    ms = {part: value / steps for part, value in total.items()}
    return ms | {"gpu": sum(ms.values())}


def run_summary(run_dir: Path) -> dict[str, float]:
    """ms/step (median, quartiles and count of the throughput windows), best val/loss and the breakdown
    of one run, from its TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    events.Reload()
    tags = events.Tags()["scalars"]
    if "train/device/batches_per_sec" not in tags:
        raise ValueError(f"{run_dir}: no train/device/batches_per_sec scalars (TokenThroughput) in its events")
    ms = sorted(1000.0 / e.value for e in events.Scalars("train/device/batches_per_sec") if e.value > 0)
    q1, median, q3 = statistics.quantiles(ms, n=4) if len(ms) > 1 else (ms[0],) * 3
    summary = {"ms_per_step": median, "ms_q1": q1, "ms_q3": q3, "windows": float(len(ms))}
    if "val/loss" in tags:
        summary["best_val_loss"] = min(e.value for e in events.Scalars("val/loss"))
    for tag in tags:
        if tag.startswith("profile/"):
            summary[tag.removeprefix("profile/")] = events.Scalars(tag)[-1].value
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Summarise training runs: ms/step, best val/loss, GPU breakdown.")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (lightning_logs/NAME/version_N)")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        if not run.is_dir():
            parser.error(f"runs: {run} is not a directory")
        try:
            rows.append((run, run_summary(run)))
        except ValueError as err:
            parser.error(str(err))
    columns = ["ms_per_step", "ms_q1", "ms_q3", "windows", "best_val_loss", "attention_forward_ms", "attention_backward_ms", "rest_ms", "gpu_ms"]
    print("| run | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for run, summary in rows:
        cells = [f"{summary[c]:.4g}" if c in summary else "-" for c in columns]
        print(f"| {run} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
