"""The comparison's plan: its arguments, and the runs they expand to (variant × grid cell × seed).

A grid axis is either a dotted override and its values (``model.optimizer.init_args.lr: [3.0e-4, 1.0e-3]``)
or a labelled axis: a name and, per label, the overrides it sets together
(``L: {"64": {data.init_args.train: [...], data.init_args.val: [...]}}``); ``exclude`` leaves out the
cells that match partial cells (``{model: plain, lr: 0.002}``). A run's folder is
``ROOT/VARIANT[/CELL]/seedS``, CELL naming the grid values (``L=64,d_model=128,lr=0.001``): the same YAML
gives the same folders.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from jsonargparse.typing import Path_fr

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # variant names, axis names and labels: they name folders
HELP = "Train every variant × grid cell × seed of a comparison, then tabulate and plot their final metrics"
VALUE_LABEL = re.compile(r"-?[A-Za-z0-9_.+-]+")  # a dotted axis's value in a folder name (0.001, -.inf, true)


@dataclass
class Select:
    """Keep, per variant and cell of the other axes, the values of ``over`` whose mean ``by`` over seeds
    is best (``mode``: max or min), as Zoology's best learning rate per cell."""

    over: list[str]
    by: str
    mode: Literal["max", "min"] = "max"


@dataclass
class PlotAxes:
    """Plot the key metric against grid axis ``x``, one panel per value of grid axis ``panels``."""

    x: str
    panels: str | None = None


@dataclass(frozen=True)
class Run:
    """One training run: a variant, the labels of its grid cell ((axis, label), in grid order), a seed."""

    index: int
    variant: str
    cell: tuple[tuple[str, str], ...]
    seed: int

    @property
    def group(self) -> str:
        """``VARIANT[/CELL]``: the run's TensorBoard name."""
        cell = ",".join(f"{axis}={label}" for axis, label in self.cell)
        return f"{self.variant}/{cell}" if cell else self.variant

    @property
    def name(self) -> str:
        return f"{self.group}/seed{self.seed}"

    def dir(self, root: Path) -> Path:
        return root / self.group / f"seed{self.seed}"


def build_parser() -> ArgumentParser:
    """The comparison's arguments; paths in the YAML are relative to the YAML's folder."""
    parser = ArgumentParser(prog="lit_thresh compare", description=HELP + " (docs/compare.md).")
    parser.add_argument("--config", action=ActionConfigFile, help="The comparison YAML.")
    parser.add_argument("--base", type=list[Path_fr], required=True, help="LightningCLI configs every run starts from.")
    parser.add_argument(
        "--variants",
        type=dict[str, dict | list[Path_fr | dict]],  # plain dicts: values kept as written
        required=True,
        help="name -> dotted overrides ({model.attention: lit_thresh.attention.SoftmaxAttention}), or a list of "
        "extra configs and dicts of dotted overrides, applied in order.",
    )
    parser.add_argument("--seeds", type=list[int], required=True, help="Every variant and cell runs once per seed.")
    parser.add_argument(
        "--grid",
        type=dict[str, list | dict],  # plain containers: values kept as written
        default={},
        help="Axes swept for every variant: dotted option -> values, or axis name -> {label: overrides}.",
    )
    parser.add_argument(
        "--exclude",
        type=list[dict],  # plain dicts: values kept as written
        default=[],
        help="Partial cells left out of the grid: axis -> label or list of labels; a cell matching all is left out.",
    )
    parser.add_argument("--select", type=Select | None, default=None, help="Axes to keep the best value of.")
    parser.add_argument("--plot", type=PlotAxes | None, default=None, help="Key metric against a grid axis.")
    parser.add_argument("--root", type=str | None, default=None, help="Output folder; default comparisons/<YAML name>.")
    parser.add_argument("--key_metric", type=str, default="val/acc", help="The metric plotted per variant.")
    parser.add_argument(
        "--metrics", type=list[str], default=["val/*", "test/*"], help="Tags (glob patterns) tabulated, in this order."
    )
    parser.add_argument("--test", type=bool, default=True, help="Also `lit_thresh test` each run (best checkpoint).")
    parser.add_argument("--extra_args", type=list[str], default=[], help="Arguments passed to every run.")
    parser.add_argument("--rerun", action="store_true", help="Rerun finished runs whose arguments changed "
                        "(the old folder is kept as <folder>.old-N); without it they are skipped with a warning.")
    parser.add_argument("--keep_going", action="store_true", help="A failing run (e.g. one that diverges) "
                        "does not stop the others; the report leaves it out and the exit status is 1.")
    parser.add_argument("--runs_per_device", type=int, default=1,
                        help="Runs at once per GPU (per group of devices_per_run GPUs); on CPU: runs at once.")
    parser.add_argument("--devices_per_run", type=int, default=1, help="GPUs per run (DDP when more than 1).")
    parser.add_argument("--list", action="store_true", help="Print the runs, numbered, and their state; run nothing.")
    parser.add_argument("--report_only", action="store_true",
                        help="Write and print the report of the runs finished so far; run nothing.")
    parser.add_argument("--only", type=int | None, default=None,
                        help="Run only run number ONLY of --list (e.g. a SLURM array task), on the given devices.")
    parser.add_argument("run_args", nargs="*", type=str, help="Arguments after `--`: passed to every run.")
    return parser


def parse(argv: Sequence[str]) -> Namespace:
    """Parses and checks ``lit_thresh compare``'s arguments (argv: those after ``compare``)."""
    cfg = build_parser().parse_args(list(argv))
    prepare(cfg)
    return cfg


def prepare(cfg: Namespace) -> None:
    """Checks a parsed comparison (ValueError naming the option) and fills in its defaults: ``run_args``
    join ``extra_args``, ``root`` defaults to comparisons/<YAML name>."""
    for path in cfg.config or []:
        check_unique_keys(Path(path.absolute))
    _check(cfg)
    cfg.extra_args = [*cfg.extra_args, *cfg.run_args]
    cfg.run_args = []
    if cfg.root is None:
        cfg.root = str(Path("comparisons") / Path(cfg.config[-1].relative).stem)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ValueError(f"{key_node.start_mark.name}, line {line}: {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def check_unique_keys(path: Path) -> None:
    """ValueError if the YAML file at path gives a key twice in one mapping (e.g. two variants of one name)."""
    with path.open() as file:
        yaml.load(file, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def _check(cfg: Namespace) -> None:
    if not cfg.seeds:
        raise ValueError("seeds: give at least one seed, e.g. seeds: [0, 1, 2]")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"seeds: each seed once, got {cfg.seeds}")
    if not cfg.variants:
        raise ValueError("variants: give at least one variant (name -> overrides or configs)")
    for name, spec in cfg.variants.items():
        if not NAME.fullmatch(name):
            raise ValueError(f"variants: name {name!r} must be letters, digits, '_', '.', '+', '-' (it names a folder)")
        for item in [spec] if isinstance(spec, dict) else spec:
            if isinstance(item, dict):
                _check_overrides(f"variants.{name}", item)
    for axis, values in cfg.grid.items():
        grid_labels(axis, values)
    exclusions(cfg)
    if not any(fnmatch.fnmatchcase(cfg.key_metric, pattern) for pattern in cfg.metrics):
        raise ValueError(f"key_metric {cfg.key_metric!r} is not matched by any of metrics {cfg.metrics}")
    if cfg.select is not None:
        unknown = [axis for axis in cfg.select.over if axis not in cfg.grid]
        if not cfg.select.over or unknown:
            raise ValueError(f"select.over: give grid axes ({list(cfg.grid)}), got {cfg.select.over}")
    if cfg.plot is not None:
        over = cfg.select.over if cfg.select is not None else []
        for field in ("x", "panels"):
            axis = getattr(cfg.plot, field)
            if axis is not None and (axis not in cfg.grid or axis in over):
                raise ValueError(f"plot.{field}: give a grid axis not in select.over ({list(cfg.grid)}), got {axis!r}")
    for option in ("runs_per_device", "devices_per_run"):
        if getattr(cfg, option) < 1:
            raise ValueError(f"{option}: give a number >= 1, got {getattr(cfg, option)}")
    if not cfg.config and cfg.root is None:
        raise ValueError("root: give the output folder (default comparisons/<name> needs --config)")


def _check_overrides(where: str, overrides: dict) -> None:
    if any(not isinstance(key, str) or not key or key.startswith("-") for key in overrides):
        raise ValueError(f"{where}: override keys are dotted options (model.config.d_model), got {list(overrides)}")


def cli_value(value: Any) -> str:
    """An override's value as the command line takes it: strings as they are, anything else as YAML flow
    (``0.001``, ``.inf``, ``.nan``, ``[{seq_len: 64, num_kv_pairs: 4}]``), which the command parses back."""
    if isinstance(value, str):
        return value
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def short_name(axis: str) -> str:
    """A dotted axis's name in folders and tables: its last part (``lr`` for model.optimizer.init_args.lr)."""
    return axis.rsplit(".", 1)[-1]


def grid_labels(axis: str, values: list | dict) -> dict[str, dict[str, Any]]:
    """label -> overrides of one grid axis; ValueError naming the axis when it cannot name folders."""
    if isinstance(values, dict):  # a labelled axis
        if not NAME.fullmatch(axis):
            raise ValueError(f"grid: labelled axis {axis!r} must be letters, digits, '_', '.', '+', '-'")
        if not values:
            raise ValueError(f"grid.{axis}: give at least one label -> overrides")
        for label, overrides in values.items():
            if not isinstance(label, str) or not NAME.fullmatch(label) or not isinstance(overrides, dict):
                raise ValueError(f"grid.{axis}: give label -> {{dotted option: value}}, got {label!r}: {overrides!r}")
            _check_overrides(f"grid.{axis}.{label}", overrides)
        return dict(values)
    _check_overrides("grid", {axis: None})
    if not values:
        raise ValueError(f"grid.{axis}: give at least one value")
    labels: dict[str, dict[str, Any]] = {}
    for value in values:
        label = cli_value(value)
        if isinstance(value, (dict, list)) or not VALUE_LABEL.fullmatch(label):
            raise ValueError(f"grid.{axis}: value {value!r} cannot name a folder; use a labelled axis "
                             f"(name: {{label: {{{axis}: value}}}})")
        if label in labels:
            raise ValueError(f"grid.{axis}: value {label} is given twice")
        labels[label] = {axis: value}
    return labels


def axis_names(cfg: Namespace) -> dict[str, str]:
    """grid axis -> its name in folders and tables (a dotted axis's last part, unless two axes share it)."""
    shorts = [short_name(axis) for axis in cfg.grid]
    return {axis: short if shorts.count(short) == 1 else axis for axis, short in zip(cfg.grid, shorts)}


def grid_overrides(cfg: Namespace) -> dict[tuple[str, str], dict[str, Any]]:
    """(axis name, label) -> the overrides it sets, for every grid value."""
    names = axis_names(cfg)
    return {(names[axis], label): overrides for axis, values in cfg.grid.items()
            for label, overrides in grid_labels(axis, values).items()}


def exclusions(cfg: Namespace) -> list[dict[str, set[str]]]:
    """``exclude`` as axis name -> the labels it leaves out, per entry; ValueError naming an entry whose axis
    or label is not in the grid. An axis is named as in ``grid`` or as in the folders (``lr``)."""
    names = axis_names(cfg)
    labels = {names[axis]: set(grid_labels(axis, values)) for axis, values in cfg.grid.items()}
    entries = []
    for index, entry in enumerate(cfg.exclude):
        where = f"exclude[{index}]"
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"{where}: give axis -> label (or a list of labels), got {entry!r}")
        parsed = {}
        for axis, values in entry.items():
            name = names.get(axis, axis)
            if name not in labels:
                raise ValueError(f"{where}: {axis!r} is not a grid axis ({', '.join(labels)})")
            given = {cli_value(value) for value in (values if isinstance(values, list) else [values])}
            unknown = sorted(given - labels[name])
            if not given or unknown:
                raise ValueError(f"{where}.{axis}: {unknown or values!r} not among its labels "
                                 f"({', '.join(sorted(labels[name]))})")
            parsed[name] = given
        entries.append(parsed)
    return entries


def expand(cfg: Namespace) -> list[Run]:
    """Every run of the comparison, numbered: for each seed, each grid cell (grid order) that ``exclude``
    leaves in, each variant."""
    names = axis_names(cfg)
    axes = [[(names[axis], label) for label in grid_labels(axis, values)] for axis, values in cfg.grid.items()]
    excluded = exclusions(cfg)
    cells = [cell for cell in itertools.product(*axes)
             if not any(all(dict(cell)[axis] in given for axis, given in entry.items()) for entry in excluded)]
    if not cells:
        raise ValueError("exclude: it leaves out every cell of the grid")
    combos = [(seed, cell, variant) for seed in cfg.seeds for cell in cells for variant in cfg.variants]
    return [Run(index, variant, tuple(cell), seed) for index, (seed, cell, variant) in enumerate(combos)]


def run_args(cfg: Namespace, run: Run) -> list[str]:
    """The run's configuration: base configs, the variant's configs and overrides (in their order), its
    grid cell's overrides, the extra arguments (later ones win)."""
    args = [f"--config={Path(path.absolute).resolve()}" for path in cfg.base]
    spec = cfg.variants[run.variant]
    for item in [spec] if isinstance(spec, dict) else spec:
        if isinstance(item, dict):
            args += [f"--{key}={cli_value(value)}" for key, value in item.items()]
        else:
            args.append(f"--config={Path(item.absolute).resolve()}")
    overrides = grid_overrides(cfg)
    for axis_label in run.cell:
        args += [f"--{key}={cli_value(value)}" for key, value in overrides[axis_label].items()]
    return [*args, *cfg.extra_args]
