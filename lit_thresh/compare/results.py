"""A finished run's results, read back from its folder: the final scalars of its TensorBoard event files
and the evaluation length of its config.yaml, written to ``results.json``."""

from __future__ import annotations

import os
from pathlib import Path

RESULTS = "results.json"  # written last, atomically: marks a finished run


def final_scalars(run_dir: Path) -> dict[str, float]:
    """The last value of every scalar in run_dir's TensorBoard event files (fit, then test), and the best
    value over the run of each validation loss, perplexity and accuracy as ``best/<tag>``."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    events.Reload()
    scalars = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    for tag in [t for t in scalars if t.startswith("val/")]:  # best over the run: best/val/loss, ...
        best = min if tag.endswith(("loss", "ppl")) else max if tag.endswith("acc") else None
        if best is not None:
            scalars[f"best/{tag}"] = best(event.value for event in events.Scalars(tag))
    # ThroughputMonitor logs the all-device rate only under DDP; on one device it is the device's
    if "train/items_per_sec" not in scalars and "train/device/items_per_sec" in scalars:
        scalars["train/items_per_sec"] = scalars["train/device/items_per_sec"]
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
