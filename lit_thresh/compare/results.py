"""A finished run's results, read back from its folder: the final scalars of its TensorBoard event files,
summaries of its attention diagnostics, and the evaluation length of its config.yaml, written to
``results.json``."""

from __future__ import annotations

import math
import os
import re
import statistics
from pathlib import Path

RESULTS = "results.json"  # written last, atomically: marks a finished run
# a per-layer or per-head diagnostic (lit_thresh.diagnostics): diag/layer{l}[/head{h}]/{name}
DIAG_TAG = re.compile(r"diag/layer\d+/(?:head\d+/)?([^/]+)")


def _after_restarts(events: list) -> list[tuple[int, float]]:
    """(step, value) of one tag's events in the order written, each dropping the earlier ones at its step
    or later: a resumed fit logs again the steps after its checkpoint, which supersede the interrupted
    fit's (TensorBoard's purge of orphaned data)."""
    kept: list[tuple[int, float]] = []
    for event in events:
        while kept and kept[-1][0] >= event.step:
            kept.pop()
        kept.append((event.step, event.value))
    return kept


def _finite_mean(values: list[float]) -> float:
    finite = [value for value in values if math.isfinite(value)]
    return statistics.fmean(finite) if finite else math.nan


def _at_step(series: list[tuple[int, float]], step: int) -> float:
    """The value of the validation logged at `step`: the first at `step` or after (Lightning logs an
    epoch's end validation at the global step - 1, the diagnostics at the global step), else the last."""
    return next((value for at, value in series if at >= step), series[-1][1])


def final_scalars(run_dir: Path, monitor: str | None = None, mode: str = "min") -> dict[str, float]:
    """The last value of every scalar in run_dir's TensorBoard event files (fit, then test; a resumed fit's
    values replace the interrupted one's), and:

    - ``best/<tag>``: the best value over the run of each validation loss, perplexity and accuracy;
    - ``diag/<name>``: each attention diagnostic (zero_frac, sink_mass, keys_attended, beta, ...) at the
      last validation, averaged over layers and heads (heads without a value, such as a sink mass of a head
      that attends nothing, left out);
    - ``best/diag/<name>``: the same at the validation with the best ``monitor`` (``mode`` min or max; the
      checkpoint monitor's, that of the best checkpoint), when it was logged.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    events.Reload()
    series = {tag: _after_restarts(events.Scalars(tag)) for tag in events.Tags()["scalars"]}
    scalars = {tag: points[-1][1] for tag, points in series.items()}
    for tag in [t for t in scalars if t.startswith("val/")]:  # best over the run: best/val/loss, ...
        best = min if tag.endswith(("loss", "ppl")) else max if tag.endswith("acc") else None
        if best is not None:
            scalars[f"best/{tag}"] = best(value for _, value in series[tag])
    # ThroughputMonitor logs the all-device rate only under DDP; on one device it is the device's
    if "train/items_per_sec" not in scalars and "train/device/items_per_sec" in scalars:
        scalars["train/items_per_sec"] = scalars["train/device/items_per_sec"]
    diagnostics: dict[str, list[list[tuple[int, float]]]] = {}
    for tag, points in series.items():
        if match := DIAG_TAG.fullmatch(tag):
            diagnostics.setdefault(match[1], []).append(points)
    best_step = None
    if monitor in series:
        pick = min if mode == "min" else max
        best_step = pick(series[monitor], key=lambda point: point[1])[0]  # the first best, as ModelCheckpoint
    for name, per_head in diagnostics.items():
        scalars[f"diag/{name}"] = _finite_mean([points[-1][1] for points in per_head])
        if best_step is not None:
            scalars[f"best/diag/{name}"] = _finite_mean([_at_step(points, best_step) for points in per_head])
    return scalars


def eval_length(config: dict) -> tuple[int | None, int | None]:
    """Sequence length and MQAR pairs of the plain ``test/...`` set (the validation settings), from a
    run's config.yaml; None where they are not single values."""
    init_args = (config.get("data") or {}).get("init_args") or {}
    if "block_size" in init_args:
        return init_args["block_size"], None
    settings = [s for s in init_args.get("val") or [] if isinstance(s, dict)]
    lengths = {s["seq_len"] for s in settings}
    pairs = {s["num_kv_pairs"] for s in settings}
    return (lengths.pop() if len(lengths) == 1 else None), (pairs.pop() if len(pairs) == 1 else None)


def write_atomic(path: Path, text: str) -> None:
    """Writes path in one step (a temporary file, then os.replace): it exists complete or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
