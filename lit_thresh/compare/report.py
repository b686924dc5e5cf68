"""A comparison's report: a row per variant and grid cell (with ``select``, the best values of the
selected axes per cell), its metrics as mean ± sample std over seeds, as Markdown, CSV and a plot."""

from __future__ import annotations

import csv
import fnmatch
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from lit_thresh.compare.plan import PlotAxes, Run, Select

# the table's fixed columns: logged tag -> heading
FIXED_COLUMNS = {"n_params": "params", "train/items_per_sec": "tokens/s", "perf/peak_memory_gib": "peak memory (GiB)"}
# length test sets: test/len{L}/{metric} or test/len{L}_n{N}/{metric}
LENGTH_TAG = re.compile(r"test/len(\d+)(?:_n(\d+))?/(.+)")


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


@dataclass
class Row:
    """A variant at one grid cell: cell holds the (axis, label) of the axes not selected over, chosen the
    selected axes' best labels; runs: the results of its seeds."""

    variant: str
    cell: tuple[tuple[str, str], ...]
    chosen: tuple[tuple[str, str], ...]
    runs: list[dict]

    @property
    def label(self) -> str:
        cell = ",".join(f"{axis}={label}" for axis, label in self.cell)
        return f"{self.variant} {cell}" if cell else self.variant


def make_rows(results: dict[Run, dict], variants: Sequence[str], over: Sequence[str] = (),
              select: Select | None = None) -> list[Row]:
    """The report's rows, by variant then grid order. over: the names of the axes selected over, whose
    best labels per row are those of the best mean ``select.by`` over seeds."""
    groups: dict[tuple[str, tuple], dict[tuple, list[dict]]] = {}
    for run in sorted(results, key=lambda run: (variants.index(run.variant), run.index)):
        cell = tuple((axis, label) for axis, label in run.cell if axis not in over)
        chosen = tuple((axis, label) for axis, label in run.cell if axis in over)
        groups.setdefault((run.variant, cell), {}).setdefault(chosen, []).append(results[run])
    rows = []
    for (variant, cell), candidates in groups.items():
        if select is None:
            rows += [Row(variant, cell, chosen, runs) for chosen, runs in candidates.items()]
            continue
        # a candidate's score: the mean of its runs' finite values; only the candidates with the most
        # finished runs compete (with --keep_going, a value that lost seeds to failures cannot win on the rest)
        values = {chosen: [v for r in runs if math.isfinite(v := r["metrics"].get(select.by, math.nan))]
                  for chosen, runs in candidates.items()}
        most = max(len(candidates[chosen]) for chosen, vals in values.items() if vals) if any(values.values()) else 0
        scores = {chosen: statistics.fmean(vals) for chosen, vals in values.items()
                  if vals and len(candidates[chosen]) == most}
        if not scores:
            raise ValueError(f"select.by {select.by!r} was not logged by any run of {Row(variant, cell, (), []).label}")
        best = (max if select.mode == "max" else min)(scores, key=scores.__getitem__)
        rows.append(Row(variant, cell, best, candidates[best]))
    return rows


def _natural(tag: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def logged_tags(rows: Iterable[Row]) -> set[str]:
    return {tag for row in rows for result in row.runs for tag in result["metrics"]}


def metric_tags(rows: Sequence[Row], patterns: Sequence[str]) -> list[str]:
    """Logged tags matched by patterns (in pattern order, then natural order), the fixed columns left out."""
    logged = logged_tags(rows) - FIXED_COLUMNS.keys()
    tags: list[str] = []
    for pattern in patterns:
        tags += sorted((t for t in logged if fnmatch.fnmatchcase(t, pattern) and t not in tags), key=_natural)
    return tags


def summaries(row: Row, tags: Iterable[str]) -> dict[str, Summary]:
    """tag -> Summary over the row's seeds that logged the tag."""
    table = {}
    for tag in tags:
        values = [result["metrics"][tag] for result in row.runs if tag in result["metrics"]]
        if values:
            table[tag] = summarize(values)
    return table


def _format(summary: Summary | None, tag: str) -> str:
    if summary is None:
        return "n/a"
    if tag == "n_params":
        return f"{summary.mean:,.0f}"
    spec = {"train/items_per_sec": ",.0f", "perf/peak_memory_gib": ".2f"}.get(tag)
    mean = format(summary.mean, spec or ".4g")
    return mean if summary.std is None else f"{mean} ± {format(summary.std, spec or '.2g')}"


def _axis_columns(rows: Sequence[Row]) -> tuple[list[str], list[str]]:
    """The grid axes' columns: the row cells' axes, then the selected axes (heading "AXIS (chosen)")."""
    if not rows:
        return [], []
    return [axis for axis, _ in rows[0].cell], [axis for axis, _ in rows[0].chosen]


def markdown_table(rows: Sequence[Row], tags: Sequence[str]) -> str:
    """A row per variant and cell: its grid values, seeds, params, tokens/s, peak memory, metrics, each
    "mean ± std" over seeds."""
    columns = [*FIXED_COLUMNS, *tags]
    cell_axes, chosen_axes = _axis_columns(rows)
    header = ["variant", *cell_axes, *(f"{axis} (chosen)" for axis in chosen_axes), "seeds",
              *FIXED_COLUMNS.values(), *tags]
    lines = [header, ["---"] * len(header)]
    for row in rows:
        table = summaries(row, columns)
        labels = [label for _, label in (*row.cell, *row.chosen)]
        lines.append([row.variant, *labels, str(len(row.runs)), *(_format(table.get(t), t) for t in columns)])
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def write_csv(path: Path, rows: Sequence[Row], tags: Sequence[str]) -> None:
    """A row per variant and cell: its grid values, seeds, then "<tag> mean" and "<tag> std" per column
    (std empty for one seed, both empty where the tag was not logged)."""
    columns = [*FIXED_COLUMNS, *tags]
    cell_axes, chosen_axes = _axis_columns(rows)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["variant", *cell_axes, *(f"{axis} (chosen)" for axis in chosen_axes), "seeds",
                         *(f"{tag} {stat}" for tag in columns for stat in ("mean", "std"))])
        for row in rows:
            table = summaries(row, columns)
            cells: list[Any] = [row.variant, *(label for _, label in (*row.cell, *row.chosen)), len(row.runs)]
            for tag in columns:
                summary = table.get(tag)
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


def _number(label: str) -> float | None:
    try:
        return float(label)
    except ValueError:
        return None


def _key_panels(rows: Sequence[Row], key_metric: str, axes: PlotAxes | None, names: dict[str, str]) -> list:
    """(title, {line: {x label: Summary}}) per panel of the key metric: one bar panel (x: the rows), or
    with axes, key_metric against axes.x, a panel per axes.panels label and a line per variant (and the
    other axes' labels)."""
    if axes is None:
        bars = {row.label: summaries(row, [key_metric]).get(key_metric) for row in rows}
        return [("", {"": {label: summary for label, summary in bars.items() if summary is not None}})]
    x, by = names[axes.x], names[axes.panels] if axes.panels else None
    panels: dict[str, dict[str, dict[str, Summary]]] = {}  # panel label -> line -> x label -> Summary
    for row in rows:
        cell = dict(row.cell)
        line = " ".join([row.variant, *(f"{a}={label}" for a, label in row.cell if a not in (x, by))])
        summary = summaries(row, [key_metric]).get(key_metric)
        if summary is not None:
            panels.setdefault(cell[by] if by else "", {}).setdefault(line, {})[cell[x]] = summary
    labels = list(panels)  # in the rows' order; numbers in increasing order, as the x axis
    if by and all(_number(label) is not None for label in labels):
        labels.sort(key=_number)
    return [(f"{by} = {label}" if by else "", panels[label]) for label in labels] or [("", {})]


def plot(path: Path, rows: Sequence[Row], key_metric: str, axes: PlotAxes | None = None,
         names: dict[str, str] | None = None) -> Figure:
    """key_metric per row (mean ± std over seeds): bars, or with axes, lines against a grid axis; and,
    where the runs have length test sets, test key_metric against sequence length per row. Rows that did
    not log key_metric are left out (named in the title). Saved as a PNG; returns the Figure."""
    from matplotlib.figure import Figure  # the Agg canvas, no pyplot state

    key_panels = _key_panels(rows, key_metric, axes, names or {})
    name = key_metric.split("/")[-1]
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}  # panel -> row -> length -> values
    for row in rows:
        for result in row.runs:
            for (panel, length), value in length_points(result, name).items():
                curves.setdefault(panel, {}).setdefault(row.label, {}).setdefault(length, []).append(value)

    count = len(key_panels) + len(curves)
    figure = Figure(figsize=(5 * count, 4), layout="constrained")
    all_axes = figure.subplots(1, count, squeeze=False)[0]
    # a key line keeps its style across the key panels; the length panels number their rows apart (a count
    # shared with every row label made a key panel's lines collide modulo matplotlib's 10 colours)
    key_lines = list(dict.fromkeys(line for _, by_line in key_panels for line in by_line))
    styles = {label: _style(i) for i, label in enumerate(row.label for row in rows)}
    styles |= {line: _style(i) for i, line in enumerate(key_lines)}
    missing = [row.label for row in rows if key_metric not in summaries(row, [key_metric])]
    for ax, (panel, by_line) in zip(all_axes, key_panels):
        title = f"{key_metric}, mean ± std over seeds" + (f", {panel}" if panel else "")
        if missing:
            title += f"\nnot logged by {len(missing)} of {len(rows)}: {', '.join(missing[:3])}"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(key_metric)
        if axes is None:
            bars = by_line.get("", {})
            ax.bar(list(bars), [s.mean for s in bars.values()], yerr=[s.std or 0.0 for s in bars.values()],
                   capsize=4, color=[styles[label]["color"] for label in bars])
            ax.tick_params(axis="x", labelrotation=20)
        else:
            _lines_against(ax, by_line, styles, (names or {})[axes.x])
    drawn = [ax for ax in all_axes[: len(key_panels)] if _has_finite_data(ax)]
    if drawn and len(key_panels) > 1:  # one y range for every panel, so that panels compare at a glance (as Zoology's)
        low, high = zip(*(ax.get_ylim() for ax in drawn))
        for ax in all_axes[: len(key_panels)]:
            ax.set_ylim(min(low), max(high))
    for ax, (panel, by_row) in zip(all_axes[len(key_panels) :], sorted(curves.items())):
        _lines_against(ax, {row: {str(k): summarize(v) for k, v in by_length.items()} for row, by_length in
                            by_row.items()}, styles, "sequence length")
        ax.set_ylabel(f"test/{name}")
        ax.set_title(f"test/{name} vs length" + (f", {panel}" if panel else ""))
    figure.savefig(path, dpi=120)
    return figure


def _style(i: int) -> dict[str, str]:
    """Line i's colour and dash: matplotlib's 10 colours solid, then dashed, dotted, dash-dotted (40 apart)."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]}


def _has_finite_data(ax: Axes) -> bool:
    """Whether a panel drew any finite value (a panel of NaNs keeps matplotlib's default y range)."""
    values = [y for line in ax.get_lines() for y in line.get_ydata()]
    values += [patch.get_height() for patch in ax.patches]
    return any(math.isfinite(y) for y in values)


def _lines_against(ax: Axes, by_line: dict[str, dict[str, Summary]], styles: dict[str, dict[str, str]],
                   xlabel: str) -> None:
    """A line per entry of by_line (x label -> Summary), styled by styles[line]: on a log2 axis where every
    label is a positive number, else at evenly spaced categories. A line breaks at an x label it has no
    value for (a cell without a finished run), rather than joining its neighbours."""
    labels = list(dict.fromkeys(label for points in by_line.values() for label in points))
    numbers = [_number(label) for label in labels]
    numeric = all(n is not None and n > 0 for n in numbers)
    if numeric:
        labels = [label for _, label in sorted(zip(numbers, labels))]
    position = {label: (_number(label) if numeric else i) for i, label in enumerate(labels)}
    for line, points in by_line.items():
        present = [i for i, label in enumerate(labels) if label in points]
        xs = labels[present[0] : present[-1] + 1]  # NaN at a gap: matplotlib breaks the line there
        ys = [points[x].mean if x in points else math.nan for x in xs]
        ax.errorbar([position[x] for x in xs], ys, yerr=[(points[x].std or 0.0) if x in points else 0.0 for x in xs],
                    marker="o", capsize=3, label=line, **styles.get(line, {}))
    if numeric:
        ax.set_xscale("log", base=2)
    ax.set_xticks([position[label] for label in labels], labels, minor=False)
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    if by_line:
        ax.legend(fontsize=8)


def write_report(root: Path, rows: Sequence[Row], patterns: Sequence[str], key_metric: str,
           axes: PlotAxes | None = None, names: dict[str, str] | None = None) -> str:
    """Writes root/results.{md,csv,png}; returns the Markdown table."""
    tags = metric_tags(rows, patterns)
    table = markdown_table(rows, tags)
    (root / "results.md").write_text(table)
    write_csv(root / "results.csv", rows, tags)
    plot(root / "results.png", rows, key_metric, axes, names)
    return table
