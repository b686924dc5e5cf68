"""``lit_thresh compare --config configs/compare/mqar.yaml``: train every variant × grid cell × seed of a
comparison, then tabulate and plot their final metrics (docs/compare.md).

A comparison YAML names the ``base`` configs, the ``variants`` (each a dict of dotted overrides, or a list
of extra config files and dicts of overrides), the ``seeds`` and optionally a ``grid`` of overrides swept
for every variant (``exclude``: cells left out) and a ``select`` (the best value of some axes per cell,
e.g. the learning rate). Every run is a subprocess of the real command (``python -m lit_thresh fit ...``,
then ``test`` from the fit's saved config.yaml and best checkpoint), logging to ``ROOT/VARIANT[/CELL]/seedS``;
runs go several at once over the visible GPUs (``--runs_per_device``, ``--devices_per_run``). Finished runs
(their ``results.json``, made with the same config contents and arguments) are skipped and unfinished ones
resume from their ``last.ckpt``, so an interrupted comparison resumes. At the end ``ROOT/results.md``,
``results.csv`` and ``results.png`` are written and the table printed. Arguments after ``--`` are passed
to every run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from jsonargparse import Namespace

from lit_thresh.compare.plan import HELP, Run, axis_names, build_parser, expand, parse, prepare, run_args
from lit_thresh.compare.results import RESULTS
from lit_thresh.compare.report import make_rows, write_report
from lit_thresh.compare.runner import Interrupted, RunFailed, device_slots, finished, run_all, signals_as_interrupt

__all__ = ["HELP", "RunFailed", "build_parser", "expand", "main", "parse", "run", "run_args"]


class _EarlyChecks:
    """Checks each run's results as soon as it finishes: a key_metric it did not log is a warning (once),
    a select.by it did not log stops the comparison (the runs finished so far are kept)."""

    def __init__(self, cfg: Namespace) -> None:
        self.cfg = cfg
        self.warned = False

    def __call__(self, run: Run, result: dict) -> None:
        logged = sorted(result["metrics"])
        if self.cfg.select is not None and self.cfg.select.by not in result["metrics"]:
            raise RunFailed(f"run {run.name} did not log select.by {self.cfg.select.by!r} (logged: {logged}); "
                            "fix select.by and rerun: finished runs are kept")
        if self.cfg.key_metric not in result["metrics"] and not self.warned:
            self.warned = True
            print(f"lit_thresh compare: warning: run {run.name} did not log key_metric {self.cfg.key_metric!r} "
                  f"(logged: {logged}); the plot leaves out the runs without it", file=sys.stderr, flush=True)


def run(cfg: Namespace) -> int:
    """Runs a parsed comparison (``lit_thresh compare``); returns the exit status: 0, or 130 on Ctrl-C.
    A failing run ends it with SystemExit (with ``--keep_going``, after the report of the others)."""
    prepare(cfg)
    runs = expand(cfg)
    if cfg.list:
        print_runs(runs, Path(cfg.root))
        return 0
    if cfg.report_only:
        results = {one: result for one in runs if (result := finished(cfg, one, show=False)) is not None}
        if not results:
            raise SystemExit(f"lit_thresh compare: no run of {len(runs)} is finished under {cfg.root}: "
                             "nothing to report")
        print(f"lit_thresh compare: the report of the {len(results)} finished runs of {len(runs)} (--report_only)")
        report_results(cfg, results)
        return 0
    if cfg.only is not None and not 0 <= cfg.only < len(runs):
        raise ValueError(f"only: give a run number of --list, 0 to {len(runs) - 1}, got {cfg.only}")
    if cfg.only is not None:  # on the devices this process was given (e.g. a SLURM array task's)
        runs, slots = [runs[cfg.only]], [{}]
    else:
        slots = device_slots(cfg.runs_per_device, cfg.devices_per_run)
    try:
        with signals_as_interrupt():
            results, failures = run_all(cfg, runs, _EarlyChecks(cfg), slots)
    except RunFailed as error:
        raise SystemExit(f"lit_thresh compare: {error}") from None
    except KeyboardInterrupt as interrupt:
        stopped = f" ({interrupt})" if isinstance(interrupt, Interrupted) and str(interrupt) else ""
        print(f"\nlit_thresh compare: interrupted{stopped}; finished runs are kept, run the command again to "
              "resume", file=sys.stderr, flush=True)
        return 130
    if cfg.only is None:
        report_results(cfg, results)
    if failures:
        first = next(iter(failures.values()))
        raise SystemExit(f"lit_thresh compare: {len(failures)} of {len(runs)} runs failed and are not in the "
                         f"report ({', '.join(run.name for run in failures)}); the first: {first}")
    return 0


def print_runs(runs: Sequence[Run], root: Path) -> None:
    """``--list``: each run's number, name and state (done, unfinished, to run), tab-separated."""
    for one in runs:
        folder = one.dir(root)
        state = "done" if (folder / RESULTS).is_file() else "unfinished" if folder.exists() else "to run"
        print(f"{one.index}\t{one.name}\t{state}")


def report_results(cfg: Namespace, results: dict[Run, dict]) -> None:
    """Writes and prints the report of the finished runs: ROOT/results.{md,csv,png}."""
    root = Path(cfg.root)
    names = axis_names(cfg)
    over = [names[axis] for axis in cfg.select.over] if cfg.select is not None else []
    rows = make_rows(results, list(cfg.variants), over, cfg.select)
    root.mkdir(parents=True, exist_ok=True)
    table = write_report(root, rows, cfg.metrics, cfg.key_metric, cfg.plot, names)
    print(f"\n{table}\nwrote {root / 'results.md'}, {root / 'results.csv'}, {root / 'results.png'}")
    print(f"dashboards: tensorboard --logdir {root}")


def main(argv: Sequence[str]) -> None:
    """``lit_thresh compare`` from Python: argv, the arguments after ``compare``."""
    cfg = build_parser().parse_args(list(argv))
    status = run(cfg)
    if status:
        raise SystemExit(status)

