"""``lit_thresh compare --config configs/compare/mqar.yaml``: train every variant × seed of a comparison,
then tabulate and plot their final metrics.

A comparison YAML names the ``base`` configs, the ``variants`` (each a dict of dotted overrides or a list
of extra config files) and the ``seeds``. Every run is a subprocess of the real command
(``python -m lit_thresh fit ...``, then ``test`` from the fit's saved config.yaml and best checkpoint), so
each gets Lightning's own DDP over all visible GPUs, and logs to ``ROOT/VARIANT/seedS`` (one TensorBoard
run each: ``tensorboard --logdir ROOT``). A run is done once its ``results.json`` exists (its final
scalars, read back from its event files); a rerun skips done runs and starts unfinished ones over. A
failing run stops the comparison. At the end ``ROOT/results.md``, ``results.csv`` and ``results.png`` are
written and the table printed. Arguments after ``--`` are passed to every run.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from jsonargparse.typing import Path_fr

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS = "results.json"  # written last, atomically: marks a finished run
# the table's fixed columns: logged tag -> heading
FIXED_COLUMNS = {"n_params": "params", "train/items_per_sec": "tokens/s", "perf/peak_memory_gib": "peak memory (GiB)"}
# length test sets: test/len{L}/{metric} or test/len{L}_n{N}/{metric}
LENGTH_TAG = re.compile(r"test/len(\d+)(?:_n(\d+))?/(.+)")
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RunFailed(RuntimeError):
    """A run of the comparison exited with an error."""


@dataclass(frozen=True)
class Summary:
    """One metric over seeds: mean and sample standard deviation (None for a single seed)."""

    mean: float
    std: float | None


def summarize(values: Sequence[float]) -> Summary:
    """Mean ± sample std of values (one per seed)."""
    if not values:
        raise ValueError("summarize needs at least one value")
    return Summary(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None)


def build_parser() -> ArgumentParser:
    """The comparison's arguments; paths in the YAML are relative to the YAML's folder."""
    parser = ArgumentParser(prog="lit_thresh compare", description=__doc__)
    parser.add_argument("--config", action=ActionConfigFile, help="The comparison YAML.")
    parser.add_argument("--base", type=list[Path_fr], required=True, help="LightningCLI configs every run starts from.")
    parser.add_argument(
        "--variants",
        type=dict[str, dict | list[Path_fr]],  # plain dict: values kept as written
        required=True,
        help="name -> dotted overrides ({model.attention: lit_thresh.attention.SoftmaxAttention}) or extra configs.",
    )
    parser.add_argument("--seeds", type=list[int], required=True, help="Every variant runs once per seed.")
    parser.add_argument("--root", type=str | None, default=None, help="Output folder; default comparisons/<YAML name>.")
    parser.add_argument("--key_metric", type=str, default="val/acc", help="The metric plotted per variant.")
    parser.add_argument(
        "--metrics", type=list[str], default=["val/*", "test/*"], help="Tags (glob patterns) tabulated, in this order."
    )
    parser.add_argument("--test", type=bool, default=True, help="Also `lit_thresh test` each run (best checkpoint).")
    parser.add_argument("--extra_args", type=list[str], default=[], help="Arguments passed to every run.")
    return parser


def parse(argv: Sequence[str]) -> Namespace:
    """Parses and checks the comparison's arguments; ``argv`` after ``--`` is appended to ``extra_args``."""
    argv, passthrough = list(argv), []
    if "--" in argv:
        argv, passthrough = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = build_parser()
    cfg = parser.parse_args(argv)
    cfg.extra_args = [*cfg.extra_args, *passthrough]
    try:
        _check(cfg)
    except ValueError as error:
        parser.error(str(error))
    if cfg.root is None:
        cfg.root = str(Path("comparisons") / Path(cfg.config[-1].relative).stem)
    return cfg


def _check(cfg: Namespace) -> None:
    if not cfg.seeds:
        raise ValueError("seeds: give at least one seed, e.g. seeds: [0, 1, 2]")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"seeds: each seed once, got {cfg.seeds}")
    if not cfg.variants:
        raise ValueError("variants: give at least one variant (name -> overrides or configs)")
    for name, spec in cfg.variants.items():
        if not VARIANT_NAME.fullmatch(name):
            raise ValueError(f"variants: name {name!r} must be letters, digits, '_', '.', '-' (it names a folder)")
        if isinstance(spec, dict) and any(not isinstance(key, str) or not key or key.startswith("-") for key in spec):
            raise ValueError(f"variants.{name}: override keys are dotted options (model.d_model), got {list(spec)}")
    if not any(fnmatch.fnmatchcase(cfg.key_metric, pattern) for pattern in cfg.metrics):
        raise ValueError(f"key_metric {cfg.key_metric!r} is not matched by any of metrics {cfg.metrics}")
    if not cfg.config and cfg.root is None:
        raise ValueError("root: give the output folder (default comparisons/<name> needs --config)")


def _cli_value(value: Any) -> str:
    """An override's value as the command line takes it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def variant_args(cfg: Namespace, variant: str) -> list[str]:
    """The run's configuration: base configs, the variant's configs or overrides, the extra arguments."""
    args = [f"--config={Path(path.absolute).resolve()}" for path in cfg.base]
    spec = cfg.variants[variant]
    if isinstance(spec, list):
        args += [f"--config={Path(path.absolute).resolve()}" for path in spec]
    else:
        args += [f"--{key}={_cli_value(value)}" for key, value in spec.items()]
    return [*args, *cfg.extra_args]


def logging_args(root: Path, variant: str, seed: int) -> list[str]:
    """Seed and TensorBoard run directory ``root/variant/seed{seed}``."""
    logger = "--trainer.logger.init_args"
    return [
        f"--seed_everything={seed}",
        f"{logger}.save_dir={root.absolute()}",
        f"{logger}.name={variant}",
        f"{logger}.version=seed{seed}",
    ]


def launch(subcommand: str, args: Sequence[str], log: Path, run: str) -> None:
    """Runs ``python -m lit_thresh SUBCOMMAND ARGS``, streaming its output to the terminal and to log."""
    command = [sys.executable, "-m", "lit_thresh", subcommand, *args]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        print(f"[{run}] lit_thresh {subcommand} (output also in {log})", flush=True)
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
        ) as process:
            for line in process.stdout:
                sys.stdout.write(line)
                out.write(line)
    if process.returncode != 0:
        raise RunFailed(f"run {run}: `lit_thresh {subcommand}` exited with code {process.returncode}; see {log}")


def best_checkpoint(run_dir: Path) -> Path:
    """The checkpoint ModelCheckpoint kept besides last.ckpt (its best, with the default save_top_k=1),
    else last.ckpt."""
    checkpoints = run_dir / "checkpoints"
    best = [path for path in checkpoints.glob("*.ckpt") if not path.name.startswith("last")]
    if len(best) == 1:
        return best[0]
    if (checkpoints / "last.ckpt").is_file():
        return checkpoints / "last.ckpt"
    raise RunFailed(f"{run_dir}: no checkpoint to test in {checkpoints} (test: true needs checkpointing)")


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


def train(cfg: Namespace, root: Path, variant: str, seed: int) -> dict:
    """Fits (and tests) one run from scratch and writes its results.json; returns the results."""
    run, run_dir = f"{variant}/seed{seed}", root / variant / f"seed{seed}"
    if run_dir.exists():
        print(f"[{run}] unfinished: removing {run_dir} and starting over", flush=True)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    args = variant_args(cfg, variant)
    launch("fit", [*args, *logging_args(root, variant, seed)], run_dir / "fit.log", run)
    if cfg.test:  # from the fit's own resolved config: immune to config files edited since
        test_args = [f"--config={run_dir / 'config.yaml'}", *logging_args(root, variant, seed)]
        launch("test", [*test_args, f"--ckpt_path={best_checkpoint(run_dir)}"], run_dir / "test.log", run)
    length, pairs = eval_length(yaml.safe_load((run_dir / "config.yaml").read_text()))
    results = {
        "variant": variant,
        "seed": seed,
        "args": args,
        "eval_length": length,
        "eval_pairs": pairs,
        "metrics": final_scalars(run_dir),
    }
    write_atomic(run_dir / RESULTS, json.dumps(results, indent=2))
    return results


def run_all(cfg: Namespace) -> dict[str, list[dict]]:
    """Every variant × seed (seed by seed), skipping finished runs; variant -> results of its seeds."""
    root = Path(cfg.root)
    results: dict[str, list[dict]] = {variant: [] for variant in cfg.variants}
    for seed in cfg.seeds:
        for variant in cfg.variants:
            run, done = f"{variant}/seed{seed}", root / variant / f"seed{seed}" / RESULTS
            if done.is_file():
                result = json.loads(done.read_text())
                print(f"[{run}] done before, skipped ({done})", flush=True)
                if result["args"] != variant_args(cfg, variant):
                    print(f"[{run}] warning: it ran with other arguments; delete {done.parent} to rerun it", flush=True)
            else:
                result = train(cfg, root, variant, seed)
            results[variant].append(result)
    return results


def _natural(tag: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def metric_tags(results: dict[str, list[dict]], patterns: Sequence[str]) -> list[str]:
    """Logged tags matched by patterns (in pattern order, then natural order), the fixed columns left out."""
    logged = {tag for runs in results.values() for result in runs for tag in result["metrics"]} - FIXED_COLUMNS.keys()
    tags: list[str] = []
    for pattern in patterns:
        tags += sorted((t for t in logged if fnmatch.fnmatchcase(t, pattern) and t not in tags), key=_natural)
    return tags


def summaries(results: dict[str, list[dict]], tags: Iterable[str]) -> dict[str, dict[str, Summary]]:
    """variant -> tag -> Summary over the seeds that logged the tag."""
    table: dict[str, dict[str, Summary]] = {}
    for variant, runs in results.items():
        table[variant] = {}
        for tag in tags:
            values = [result["metrics"][tag] for result in runs if tag in result["metrics"]]
            if values:
                table[variant][tag] = summarize(values)
    return table


def _format(summary: Summary | None, tag: str) -> str:
    if summary is None:
        return "n/a"
    if tag == "n_params":
        return f"{summary.mean:,.0f}"
    spec = {"train/items_per_sec": ",.0f", "perf/peak_memory_gib": ".2f"}.get(tag)
    mean = format(summary.mean, spec or ".4g")
    return mean if summary.std is None else f"{mean} ± {format(summary.std, spec or '.2g')}"


def markdown_table(results: dict[str, list[dict]], tags: Sequence[str]) -> str:
    """Variants × (seeds, params, tokens/s, peak memory, metrics), each "mean ± std" over seeds."""
    columns = [*FIXED_COLUMNS, *tags]
    table = summaries(results, columns)
    header = ["variant", "seeds", *FIXED_COLUMNS.values(), *tags]
    rows = [[v, str(len(results[v])), *(_format(table[v].get(t), t) for t in columns)] for v in results]
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def write_csv(path: Path, results: dict[str, list[dict]], tags: Sequence[str]) -> None:
    """One row per variant: seeds, then "<tag> mean" and "<tag> std" per column (std empty for one seed,
    both empty where the tag was not logged)."""
    columns = [*FIXED_COLUMNS, *tags]
    table = summaries(results, columns)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["variant", "seeds", *(f"{tag} {stat}" for tag in columns for stat in ("mean", "std"))])
        for variant, runs in results.items():
            cells: list[Any] = [variant, len(runs)]
            for tag in columns:
                summary = table[variant].get(tag)
                cells += ["", ""] if summary is None else [summary.mean, "" if summary.std is None else summary.std]
            writer.writerow(cells)


def length_points(result: dict, name: str) -> dict[tuple[str, int], float]:
    """(panel, length) -> one run's test ``name`` on its length test sets, plus the plain ``test/name`` at
    its evaluation length (L0, N0). Panels: N held at N0 ("N = 16"), N scaled with the length, other N."""
    length0, pairs0 = result["eval_length"], result["eval_pairs"]
    fixed, scaled = f"N = {pairs0}", f"N ∝ length ({pairs0} at {length0})"
    points: dict[tuple[str, int], float] = {}
    for tag, value in result["metrics"].items():
        match = LENGTH_TAG.fullmatch(tag)
        if match is None or match[3] != name:
            continue
        length, pairs = int(match[1]), (int(match[2]) if match[2] else None)
        if pairs is None:
            panel = ""
        elif pairs == pairs0:
            panel = fixed
        elif length0 and pairs0 and pairs * length0 == pairs0 * length:
            panel = scaled
        else:
            panel = f"N = {pairs}"
        points[panel, length] = value
    plain = result["metrics"].get(f"test/{name}")
    if length0 and plain is not None:
        for panel in {panel for panel, _ in points} & {"", fixed, scaled}:
            points[panel, length0] = plain
    return points


def plot(path: Path, results: dict[str, list[dict]], key_metric: str) -> Figure:
    """Bar chart of key_metric per variant (mean ± std over seeds) and, where the runs have length test
    sets, test key_metric against sequence length per variant; saved as a PNG. Returns the Figure."""
    from matplotlib.figure import Figure  # the Agg canvas, no pyplot state

    table = summaries(results, [key_metric])
    missing = [variant for variant in results if key_metric not in table[variant]]
    if missing:
        logged = sorted({tag for runs in results.values() for result in runs for tag in result["metrics"]})
        raise ValueError(f"key_metric {key_metric!r} was not logged by {missing}; logged: {logged}")
    name = key_metric.split("/")[-1]
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}  # panel -> variant -> length -> values
    for variant, runs in results.items():
        for result in runs:
            for (panel, length), value in length_points(result, name).items():
                curves.setdefault(panel, {}).setdefault(variant, {}).setdefault(length, []).append(value)

    figure = Figure(figsize=(5 * (1 + len(curves)), 4), layout="constrained")
    bars, *panels = figure.subplots(1, 1 + len(curves), squeeze=False)[0]
    colors = {variant: f"C{i}" for i, variant in enumerate(results)}  # one colour per variant in every panel
    stats = [table[variant][key_metric] for variant in results]
    means, stds = [s.mean for s in stats], [s.std or 0.0 for s in stats]
    bars.bar(list(results), means, yerr=stds, capsize=4, color=list(colors.values()))
    bars.set_ylabel(key_metric)
    bars.set_title(f"{key_metric}, mean ± std over seeds")
    bars.tick_params(axis="x", labelrotation=20)
    for ax, (panel, by_variant) in zip(panels, sorted(curves.items())):
        for variant, by_length in by_variant.items():
            lengths = sorted(by_length)
            points = [summarize(by_length[length]) for length in lengths]
            means, stds = [p.mean for p in points], [p.std or 0.0 for p in points]
            ax.errorbar(lengths, means, yerr=stds, marker="o", capsize=3, label=variant, color=colors[variant])
        ticks = sorted({length for by_length in by_variant.values() for length in by_length})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(length) for length in ticks], minor=False)
        ax.minorticks_off()
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"test/{name}")
        ax.set_title(f"test/{name} vs length" + (f", {panel}" if panel else ""))
        ax.legend()
    figure.savefig(path, dpi=120)
    return figure


def report(cfg: Namespace, results: dict[str, list[dict]]) -> str:
    """Writes ROOT/results.{md,csv,png}; returns the Markdown table."""
    root = Path(cfg.root)
    tags = metric_tags(results, cfg.metrics)
    table = markdown_table(results, tags)
    (root / "results.md").write_text(table)
    write_csv(root / "results.csv", results, tags)
    plot(root / "results.png", results, cfg.key_metric)
    return table


def main(argv: Sequence[str]) -> None:
    """``lit_thresh compare --config COMPARE.yaml [-- ARGS FOR EVERY RUN]``; argv: the arguments after ``compare``."""
    cfg = parse(argv)
    try:
        results = run_all(cfg)
    except RunFailed as error:
        raise SystemExit(f"lit_thresh compare: {error}") from None
    table = report(cfg, results)
    root = Path(cfg.root)
    print(f"\n{table}\nwrote {root / 'results.md'}, {root / 'results.csv'}, {root / 'results.png'}")
    print(f"dashboards: tensorboard --logdir {root}")
