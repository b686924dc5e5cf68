"""``lit_thresh compare``: a tiny version of Zoology's grid (configs/compare/zoology_grid.yaml), its two runs
at once through the installed command on CPU, its resumption; and on their own: the grid's expansion and
folder names, the best value per cell, --rerun, --only/--list, the argument checks, the table, CSV and plot.
tests/test_compare_runs.py: resuming unfinished runs, changed config contents, locks, the best checkpoint."""

import csv
import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.tensorboard import SummaryWriter

from lit_thresh import cli, compare
from lit_thresh.compare import plan, report, runner
from lit_thresh.compare.plan import Run
from tests.test_cli import CONFIGS, QUICKSTART, run_cli

ZOOLOGY = CONFIGS / "compare" / "zoology_grid.yaml"
# the quickstart's data shrunk to one epoch of 2 steps on CPU
TINY = {
    "trainer": {"accelerator": "cpu", "max_epochs": 1, "enable_progress_bar": False},
    "data": {"init_args": {"vocab_size": 128, "batch_size": 16}},
}
TINY_L = {
    "data.init_args.train": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 32}],
    "data.init_args.val": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 32}],
    "data.init_args.test_length_multipliers": [],
}


def write_comparison(folder: Path, **fields) -> Path:
    """A comparison YAML in folder over the tiny quickstart: softmax by an override, threshold with
    beta 0.5 by an extra config file."""
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    (folder / "beta.yaml").write_text("model:\n  config:\n    attention:\n      init_args:\n        beta: 0.5\n")
    comparison = {
        "base": [str(QUICKSTART), "tiny.yaml"],
        "variants": {
            "softmax": {"model.config.attention": "lit_thresh.attention.SoftmaxAttention"},
            "threshold": ["beta.yaml"],
        },
        "seeds": [0, 1],
        "metrics": ["val/acc", "val/loss"],
        "test": False,
        **fields,
    }
    path = folder / "tiny_compare.yaml"
    path.write_text(yaml.safe_dump(comparison, sort_keys=False))
    return path


def tiny_zoology(folder: Path) -> Path:
    """configs/compare/zoology_grid.yaml shrunk: softmax and threshold, one (L, N) of 32 tokens, Zoology's
    model (learned positions), d_model 16, lr 3e-3, one seed; on CPU, one epoch of 2 steps."""
    grid = yaml.safe_load(ZOOLOGY.read_text())
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    configs = ZOOLOGY.parent
    grid["base"] = [str((configs / path).resolve()) for path in grid["base"]] + ["tiny.yaml"]
    grid["variants"] = {
        name: [str((configs / path).resolve()) for path in grid["variants"][name]] for name in ("softmax", "threshold")
    }
    grid["grid"] = {
        "L": {"32": TINY_L},
        "model": {"zoology": grid["grid"]["model"]["zoology"]},
        "model.config.d_model": [16],
        "model.optimizer.init_args.lr": [3.0e-3],
    }
    path = folder / "tiny_zoology.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, str]:
    """The tiny Zoology grid run by the installed command, its 2 runs at once; returns its folder and output."""
    folder = tmp_path_factory.mktemp("compare")
    result = run_cli("compare", "--config", str(tiny_zoology(folder)), "--runs_per_device", "2", cwd=folder)
    return folder, result.stdout


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


CELL = "L=32,model=zoology,d_model=16,lr=0.003"


@pytest.mark.slow
def test_tiny_zoology_grid_runs_two_at_once_and_writes_table_csv_and_plot(compared):
    folder, stdout = compared
    root = folder / "comparisons" / "tiny_zoology"
    runs = {variant: root / variant / CELL / "seed0" for variant in ("softmax", "threshold")}
    results = {variant: json.loads((run / "results.json").read_text()) for variant, run in runs.items()}
    for variant, result in results.items():
        config = yaml.safe_load((runs[variant] / "config.yaml").read_text())
        assert config["model"]["config"]["attention"]["class_path"].lower().endswith(f".{variant}attention")
        assert config["model"]["config"]["positional"] == "learned" and config["model"]["config"]["key_conv"] == 0
        assert (config["model"]["config"]["d_model"], config["model"]["optimizer"]["init_args"]["lr"]) == (16, 0.003)
        assert config["data"]["init_args"]["train"] == TINY_L["data.init_args.train"]
        assert 0 <= result["metrics"]["best/val/acc"] <= 1 and result["cell"]["L"] == "32"
    # both at once: each started before the other finished, on one CPU thread each (2 cores)
    a, b = results["softmax"], results["threshold"]
    assert a["started"] < b["finished"] and b["started"] < a["finished"]
    assert stdout.count("on OMP_NUM_THREADS=1") == 2

    rows = read_csv(root / "results.csv")
    assert [(row["variant"], row["L"], row["model"], row["d_model"], row["lr (chosen)"]) for row in rows] == [
        (variant, "32", "zoology", "16", "0.003") for variant in ("softmax", "threshold")
    ]
    for row in rows:
        assert float(row["best/val/acc mean"]) == pytest.approx(results[row["variant"]]["metrics"]["best/val/acc"])
    table = (root / "results.md").read_text()
    assert table.splitlines()[0].startswith("| variant | L | model | d_model | lr (chosen) | seeds | params |")
    assert table in stdout
    assert (root / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_rerun_skips_finished_runs(compared, capsys, monkeypatch):
    folder, _ = compared
    root = folder / "comparisons" / "tiny_zoology"
    files = [p for p in root.glob("*/*/seed*/**/*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in files}
    csv_before = (root / "results.csv").read_text()
    monkeypatch.chdir(folder)
    compare.main(["--config", str(folder / "tiny_zoology.yaml")])
    out = capsys.readouterr().out
    assert out.count("done before, skipped") == 2 and "lit_thresh fit" not in out
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert (root / "results.csv").read_text() == csv_before


def test_help_lists_compare(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit_thresh", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0
    assert any(line.split()[:1] == ["compare"] for line in capsys.readouterr().out.splitlines())


def write_grid(folder: Path, **fields) -> Path:
    """write_comparison with a grid: a dotted axis (the lr) and a labelled one (the data's length)."""
    grid = {
        "model.optimizer.init_args.lr": [1.0e-3, 3.0e-3],
        "L": {"16": {"data.init_args.batch_size": 4}, "32": {"data.init_args.batch_size": 8, "trainer.max_steps": 3}},
    }
    return write_comparison(folder, **({"grid": grid} | fields))


def test_grid_expands_to_stably_named_runs_with_their_overrides(tmp_path):
    cfg = plan.parse(["--config", str(write_grid(tmp_path)), "--", "--trainer.max_epochs=2"])
    runs = plan.expand(cfg)
    cells = ["lr=0.001,L=16", "lr=0.001,L=32", "lr=0.003,L=16", "lr=0.003,L=32"]
    names = [f"{v}/{cell}/seed{s}" for s in (0, 1) for cell in cells for v in ("softmax", "threshold")]
    assert [run.name for run in runs] == names and [run.index for run in runs] == list(range(16))
    assert [run.name for run in plan.expand(plan.parse(["--config", str(tmp_path / "tiny_compare.yaml")]))] == names
    assert runs[3].dir(Path("R")) == Path("R/threshold/lr=0.001,L=32/seed0")
    args = plan.run_args(cfg, runs[3])
    assert args[:3] == [f"--config={QUICKSTART.resolve()}", f"--config={tmp_path / 'tiny.yaml'}",
                        f"--config={tmp_path / 'beta.yaml'}"]
    assert args[3:] == ["--model.optimizer.init_args.lr=0.001", "--data.init_args.batch_size=8",
                        "--trainer.max_steps=3", "--trainer.max_epochs=2"]
    # axes of one last name are named in full
    cfg = plan.parse(["--config", str(write_grid(tmp_path, grid={"a.lr": [1], "b.lr": [2]}))])
    assert plan.expand(cfg)[0].name == "softmax/a.lr=1,b.lr=2/seed0"


def test_exclude_leaves_out_the_cells_it_matches(tmp_path):
    grid = {"qk": {"plain": {"a.qk_norm": False}, "norm": {"a.qk_norm": True}},
            "model.config.attention.init_args.power": [1.0, 2.0], "model.optimizer.init_args.lr": [1.0e-3, 2.0e-3]}
    exclude = [{"qk": "plain", "power": 1.0}, {"qk": ["plain"], "model.optimizer.init_args.lr": [2.0e-3]}]
    cfg = plan.parse(["--config", str(write_grid(tmp_path, grid=grid, exclude=exclude, seeds=[0],
                                                 variants={"threshold": {}}))])
    cells = [",".join(f"{axis}={label}" for axis, label in run.cell) for run in plan.expand(cfg)]
    assert cells == ["qk=plain,power=2.0,lr=0.001"] + [f"qk=norm,power={p},lr={lr}" for p in ("1.0", "2.0")
                                                       for lr in ("0.001", "0.002")]
    assert [run.index for run in plan.expand(cfg)] == list(range(5))  # numbered after the exclusion (--only)


@pytest.mark.parametrize(
    ("exclude", "message"),
    [
        ([{"dropout": 0.1}], r"exclude\[0\]: 'dropout' is not a grid axis \(qk, lr\)"),
        ([{"qk": "other"}], r"exclude\[0\].qk: \['other'\] not among its labels \(norm, plain\)"),
        ([{"lr": 1}], r"exclude\[0\].lr: \['1'\] not among its labels \(0.001\)"),
        ([{}], r"exclude\[0\]: give axis -> label"),
        ([{"qk": ["plain", "norm"]}], "exclude: it leaves out every cell of the grid"),
    ],
)
def test_bad_exclude_is_a_clear_error(tmp_path, exclude, message):
    grid = {"qk": {"plain": {"a.b": 1}, "norm": {"a.b": 2}}, "model.optimizer.init_args.lr": [1.0e-3]}
    with pytest.raises(ValueError, match=message):
        plan.expand(plan.parse(["--config", str(write_grid(tmp_path, grid=grid, exclude=exclude))]))


def test_a_variant_mixes_config_files_and_overrides_in_order(tmp_path):
    variants = {"threshold": ["beta.yaml", {"model.config.attention.init_args.beta": 2.0}, "tiny.yaml"]}
    cfg = plan.parse(["--config", str(write_comparison(tmp_path, variants=variants))])
    args = plan.run_args(cfg, plan.expand(cfg)[0])
    assert args[2:] == [f"--config={tmp_path / 'beta.yaml'}", "--model.config.attention.init_args.beta=2.0",
                        f"--config={tmp_path / 'tiny.yaml'}"]
    with pytest.raises(ValueError, match="variants.threshold: override keys are dotted options"):
        plan.parse(["--config", str(write_comparison(tmp_path, variants={"threshold": ["beta.yaml", {"-x": 1}]}))])


def test_inf_and_nan_reach_the_runs_as_the_command_takes_them(tmp_path, capsys, monkeypatch):
    variants = {"a": {"trainer.gradient_clip_val": math.inf, "model.x": [-math.inf, math.nan], "model.y": "inf"}}
    cfg = plan.parse(["--config", str(write_grid(tmp_path, variants=variants, grid={}))])
    args = plan.run_args(cfg, plan.expand(cfg)[0])
    assert args[2:5] == ["--trainer.gradient_clip_val=.inf", "--model.x=[-.inf, .nan]", "--model.y=inf"]
    monkeypatch.setattr(sys, "argv", ["lit_thresh", "fit", f"--config={QUICKSTART}", args[2], "--print_config"])
    with pytest.raises(SystemExit):
        cli.main()
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["gradient_clip_val"] == math.inf


def fake_result(rng: torch.Generator, tags: list[str]) -> dict:
    return {"metrics": {tag: torch.rand((), generator=rng).item() for tag in tags}, "eval_length": 32, "eval_pairs": 4}


@pytest.mark.parametrize("mode", ["max", "min"])
def test_select_keeps_the_best_mean_over_seeds_per_cell(mode):
    """Fake results of 2 variants x 2 widths x 3 lr x 3 seeds: each row is the lr whose mean over seeds is best."""
    rng = torch.Generator().manual_seed(3)
    lrs, widths, seeds = ["0.0003", "0.001", "0.003"], ["64", "128"], [0, 1, 2]
    results, index = {}, 0
    for seed in seeds:
        for width in widths:
            for lr in lrs:
                for variant in ("softmax", "threshold"):
                    run = Run(index, variant, (("d_model", width), ("lr", lr)), seed)
                    results[run] = fake_result(rng, ["best/val/acc", "val/loss"])
                    index += 1
    select = plan.Select(over=["model.optimizer.init_args.lr"], by="best/val/acc", mode=mode)
    rows = report.make_rows(results, ["softmax", "threshold"], ["lr"], select)
    assert [(row.variant, row.cell) for row in rows] == [
        (variant, (("d_model", width),)) for variant in ("softmax", "threshold") for width in widths
    ]
    for row in rows:
        means = {}
        for lr in lrs:
            runs = [r for r in results if r.variant == row.variant and r.cell == (row.cell[0], ("lr", lr))]
            means[lr] = torch.tensor([results[r]["metrics"]["best/val/acc"] for r in runs], dtype=torch.float64).mean()
        best = (max if mode == "max" else min)(means, key=means.__getitem__)
        assert row.chosen == (("lr", best),) and len(row.runs) == 3
        assert report.summaries(row, ["best/val/acc"])["best/val/acc"].mean == pytest.approx(means[best].item())
    table = report.markdown_table(rows, ["best/val/acc"]).splitlines()
    assert table[0] == ("| variant | d_model | lr (chosen) | seeds | params | tokens/s | peak memory (GiB) "
                        "| best/val/acc |")
    assert table[2].startswith(f"| softmax | 64 | {rows[0].chosen[0][1]} | 3 |")


def test_select_ranks_values_that_lost_seeds_or_diverged_behind_complete_ones():
    """lr 0.003 has the best value on its one surviving seed (the others failed, --keep_going) and lr 0.01
    a NaN: lr 0.001, complete and finite, is chosen."""
    values = {"0.001": [0.90, 0.92, 0.91], "0.003": [0.99], "0.01": [math.nan, math.nan, math.nan]}
    results = {}
    for lr, accs in values.items():
        for seed, acc in enumerate(accs):
            results[Run(len(results), "softmax", (("lr", lr),), seed)] = {"metrics": {"best/val/acc": acc}}
    select = plan.Select(over=["model.optimizer.init_args.lr"], by="best/val/acc", mode="max")
    (row,) = report.make_rows(results, ["softmax"], ["lr"], select)
    assert row.chosen == (("lr", "0.001"),) and len(row.runs) == 3


def test_table_and_csv_are_mean_and_std_over_seeds(tmp_path):
    rng = torch.Generator().manual_seed(0)
    tags = ["val/acc", "test/len64_n4/acc", "test/len128_n4/acc", "n_params"]
    results = {Run(i, "a", (), i): fake_result(rng, tags) for i in range(3)}
    results[Run(3, "b", (), 0)] = fake_result(rng, ["val/acc", "n_params"])
    rows = report.make_rows(results, ["a", "b"])
    tags = report.metric_tags(rows, ["val/*", "test/*"])
    assert tags == ["val/acc", "test/len64_n4/acc", "test/len128_n4/acc"]  # pattern order, then natural order

    report.write_csv(tmp_path / "t.csv", rows, tags)
    csv_rows = {row["variant"]: row for row in read_csv(tmp_path / "t.csv")}
    values = torch.tensor([r["metrics"]["val/acc"] for r in rows[0].runs], dtype=torch.float64)
    assert float(csv_rows["a"]["val/acc mean"]) == pytest.approx(values.mean().item(), rel=1e-12)
    assert float(csv_rows["a"]["val/acc std"]) == pytest.approx(values.std().item(), rel=1e-12)  # sample std
    assert float(csv_rows["b"]["val/acc mean"]) == pytest.approx(rows[1].runs[0]["metrics"]["val/acc"])
    assert csv_rows["b"]["val/acc std"] == "" and csv_rows["b"]["test/len64_n4/acc mean"] == ""  # one seed; not logged

    lines = report.markdown_table(rows, tags).splitlines()
    assert lines[0].startswith("| variant | seeds | params | tokens/s | peak memory (GiB) | val/acc |")
    a, b = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])
    assert a[5] == f"{values.mean().item():.4g} ± {values.std().item():.2g}"
    assert b[1] == "1" and " ± " not in b[5] and b[6] == "n/a" and b[3] == "n/a"  # no tokens/s on a CPU run


def test_final_scalars_length_points_and_plot(tmp_path):
    rng = torch.Generator().manual_seed(1)
    final: dict[str, float] = {}
    logged: dict[str, list[float]] = {}
    for part, tags in [("fit", ["val/acc"]), ("test", ["test/acc", "test/len64_n4/acc", "test/len64_n8/acc"])]:
        writer = SummaryWriter(tmp_path, filename_suffix=part)
        for step in range(3):
            for tag in tags:
                final[tag] = torch.rand((), generator=rng).item()
                logged.setdefault(tag, []).append(final[tag])
                writer.add_scalar(tag, final[tag], step)
        writer.close()
    metrics = compare.results.final_scalars(tmp_path)
    # the last value of every tag, from both event files, and the best validation accuracy of the run
    assert metrics == pytest.approx(final | {"best/val/acc": max(logged["val/acc"])})

    result = {"metrics": metrics, "eval_length": 32, "eval_pairs": 4}
    assert report.length_points(result, "acc") == {
        ("N = 4", 32): metrics["test/acc"],
        ("N = 4", 64): metrics["test/len64_n4/acc"],
        ("N ∝ length (4 at 32)", 32): metrics["test/acc"],
        ("N ∝ length (4 at 32)", 64): metrics["test/len64_n8/acc"],
    }
    rows = [report.Row("v", (), (), [result, result])]
    figure = report.plot(tmp_path / "plot.png", rows, "val/acc")
    assert len(figure.axes) == 3 and (tmp_path / "plot.png").stat().st_size > 0
    # a key metric no run logged: the plot is still written, saying so
    figure = report.plot(tmp_path / "missing.png", rows, "val/loss")
    assert "not logged by 1 of 1: v" in figure.axes[0].get_title() and (tmp_path / "missing.png").stat().st_size > 0


def test_plot_against_a_grid_axis_has_a_panel_per_label_and_a_line_per_variant(tmp_path):
    rng = torch.Generator().manual_seed(2)
    variants = ["softmax", "threshold", "diff_threshold", "diff_softmax"]
    lengths = ("64", "128", "256")  # 9 rows a variant: with 4 variants, 36 row labels besides the 4 lines
    cells = [(v, length, w) for v in variants for length in lengths for w in ("64", "128", "256")]
    results = {
        Run(i, variant, (("L", length), ("d_model", width)), 0): fake_result(rng, ["best/val/acc"])
        for i, (variant, length, width) in enumerate(cells)
    }
    rows = report.make_rows(results, variants)
    names = {"L": "L", "model.config.d_model": "d_model"}
    axes = plan.PlotAxes(x="model.config.d_model", panels="L")
    figure = report.plot(tmp_path / "p.png", rows, "best/val/acc", axes, names)
    titles = [f"best/val/acc, mean ± std over seeds, L = {length}" for length in lengths]
    assert [ax.get_title() for ax in figure.axes] == titles
    for ax, length in zip(figure.axes, lengths):
        assert [bars.get_label() for bars in ax.containers] == variants  # errorbar: a line each
        colours = [bars.lines[0].get_color() for bars in ax.containers]
        assert len(set(colours)) == 4 and colours == [c.lines[0].get_color() for c in figure.axes[0].containers]
        for bars in ax.containers:
            line = bars.lines[0]
            runs = [run for run in results if run.variant == bars.get_label() and run.cell[0] == ("L", length)]
            assert list(line.get_xdata()) == [64, 128, 256]
            assert list(line.get_ydata()) == pytest.approx([results[run]["metrics"]["best/val/acc"] for run in runs])
    assert figure.axes[0].get_ylim() == figure.axes[2].get_ylim()  # one y range: the panels compare at a glance


def test_plot_panels_follow_their_numbers_whichever_variant_ran_where(tmp_path):
    """Panels by a numeric axis come in increasing order even when the first variant's only run is at the
    largest value (a slice of a grid), not in the order the rows meet them."""
    rng = torch.Generator().manual_seed(7)
    cells = [("softmax", "256"), ("threshold", "64"), ("threshold", "128"), ("threshold", "512")]
    results = {Run(i, variant, (("L", length), ("d_model", "64")), 0): fake_result(rng, ["best/val/acc"])
               for i, (variant, length) in enumerate(cells)}
    rows = report.make_rows(results, ["softmax", "threshold"])
    axes = plan.PlotAxes(x="model.config.d_model", panels="L")
    figure = report.plot(tmp_path / "p.png", rows, "best/val/acc", axes, {"L": "L", "model.config.d_model": "d_model"})
    assert [ax.get_title().rsplit("L = ", 1)[1] for ax in figure.axes] == ["64", "128", "256", "512"]
    assert [c.get_label() for c in figure.axes[2].containers] == ["softmax"]


def test_plot_lines_break_at_cells_without_a_run(tmp_path):
    """softmax has no run at d_model 128, threshold none at 64: softmax's line breaks there (no segment joins
    64 and 256), threshold's starts at 128."""
    rng = torch.Generator().manual_seed(6)
    cells = [("softmax", "64"), ("softmax", "256"), ("threshold", "128"), ("threshold", "256")]
    results = {Run(i, variant, (("d_model", width),), 0): fake_result(rng, ["best/val/acc"])
               for i, (variant, width) in enumerate(cells)}
    rows = report.make_rows(results, ["softmax", "threshold"])
    axes = plan.PlotAxes(x="model.config.d_model")
    figure = report.plot(tmp_path / "p.png", rows, "best/val/acc", axes, {"model.config.d_model": "d_model"})
    softmax, threshold = (bars.lines[0] for bars in figure.axes[0].containers)
    assert list(softmax.get_xdata()) == [64, 128, 256] and math.isnan(softmax.get_ydata()[1])
    assert list(threshold.get_xdata()) == [128, 256] and not any(map(math.isnan, threshold.get_ydata()))


def test_plot_lines_stay_apart_past_ten_rows(tmp_path):
    """12 rows with length test sets: the length panel's 12 lines differ in colour or dash (matplotlib's
    colour cycle alone repeats after 10)."""
    rng = torch.Generator().manual_seed(5)
    rows = [report.Row(f"v{i}", (), (), [fake_result(rng, ["val/acc", "test/acc", "test/len64_n4/acc"])])
            for i in range(12)]
    figure = report.plot(tmp_path / "p.png", rows, "val/acc")
    lines = figure.axes[1].containers  # the length panel: an errorbar per row
    assert len(lines) == 12
    styles = {(c.lines[0].get_color(), c.lines[0].get_linestyle()) for c in lines}
    assert len(styles) == 12


def test_plot_panels_share_the_y_range_of_the_panels_with_values(tmp_path):
    """A panel whose runs all logged NaN neither stretches the shared y range (matplotlib's default 0..1)
    nor breaks the plot."""
    rng = torch.Generator().manual_seed(4)
    results = {}
    for i, (length, width) in enumerate((length, w) for length in ("64", "128") for w in ("64", "128")):
        result = fake_result(rng, ["best/val/acc"])
        result["metrics"]["best/val/acc"] = 0.97 + 0.02 * result["metrics"]["best/val/acc"] if length == "64" else math.nan
        results[Run(i, "softmax", (("L", length), ("d_model", width)), 0)] = result
    rows = report.make_rows(results, ["softmax"])
    axes = plan.PlotAxes(x="model.config.d_model", panels="L")
    figure = report.plot(tmp_path / "p.png", rows, "best/val/acc", axes, {"L": "L", "model.config.d_model": "d_model"})
    low, high = figure.axes[0].get_ylim()
    assert 0.96 < low < high < 1.0 and figure.axes[1].get_ylim() == (low, high)


def fake_fit(tags: dict[str, float], calls: list):
    """A stand-in for runner.launch: records the call and writes what a fit leaves (config.yaml, events)."""

    def launch(subcommand, args, log, run, env, prefix):
        calls.append((subcommand, run, args))
        log.write_text("fit\n")
        (log.parent / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": {"val": []}}}))
        writer = SummaryWriter(log.parent)
        for tag, value in tags.items():
            writer.add_scalar(tag, value, 0)
        writer.close()

    return launch


def test_changed_arguments_are_skipped_with_a_warning_and_rerun_keeps_the_old_run(tmp_path, capsys, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, calls))
    config = str(write_comparison(tmp_path, seeds=[0], variants={"softmax": {}}))
    root = ["--root", str(tmp_path / "out")]
    compare.main(["--config", config, *root])
    run = tmp_path / "out" / "softmax" / "seed0"
    first = json.loads((run / "results.json").read_text())
    assert len(calls) == 1 and first["metrics"]["val/acc"] == 0.25

    compare.main(["--config", config, *root, "--", "--trainer.max_epochs=3"])
    assert len(calls) == 1 and ("done before with another configuration (newly given: --trainer.max_epochs=3), "
                                "skipped; --rerun") in capsys.readouterr().out

    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.5}, calls))
    compare.main(["--config", config, *root, "--rerun", "--", "--trainer.max_epochs=3"])
    assert len(calls) == 2 and calls[1][2][-5] == "--trainer.max_epochs=3"
    assert json.loads((run / "results.json").read_text())["metrics"]["val/acc"] == 0.5
    assert json.loads((run.parent / "seed0.old-1" / "results.json").read_text()) == first  # kept, renamed
    assert "seed0.old-1" in capsys.readouterr().out


def test_unfinished_run_starts_over_and_a_failure_names_it(tmp_path, monkeypatch):
    config = str(write_comparison(tmp_path, seeds=[0]))
    root = tmp_path / "out"
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, []))
    compare.main(["--config", config, "--root", str(root)])
    run_dir = root / "threshold" / "seed0"
    (run_dir / "results.json").unlink()  # and its fit never finished (no last.ckpt to resume from either):
    started = json.loads((run_dir / "started.json").read_text())
    (run_dir / "started.json").write_text(json.dumps({k: v for k, v in started.items() if k != "fitted"}))
    launched = []

    def failing_launch(subcommand, args, log, run, env, prefix):
        launched.append((subcommand, run, sorted(p.name for p in log.parent.iterdir())))
        raise runner.RunFailed(f"run {run}: `lit_thresh {subcommand}` exited with code 1; see {log}")

    monkeypatch.setattr(runner, "launch", failing_launch)
    with pytest.raises(SystemExit, match=r"threshold/seed0.*exited with code 1; see .*threshold/seed0/fit\.log"):
        compare.main(["--config", config, "--root", str(root)])
    assert launched == [("fit", "threshold/seed0", ["started.json"])]  # only the unfinished run, in a fresh folder
    assert (root / "threshold" / "seed0.old-1" / "fit.log").is_file()  # the unfinished one, kept


def test_keep_going_reports_the_other_runs_then_fails(tmp_path, capsys, monkeypatch):
    """With --keep_going a diverging lr does not stop the sweep: its cell keeps the other lr."""
    fit = fake_fit({"val/acc": 0.5}, [])

    def launch(subcommand, args, log, run, env, prefix):
        if "lr=0.003" in run and "threshold" in run:
            raise runner.RunFailed(f"run {run}: `lit_thresh fit` exited with code 1; see {log}")
        fit(subcommand, args, log, run, env, prefix)

    monkeypatch.setattr(runner, "launch", launch)
    select = {"over": ["model.optimizer.init_args.lr"], "by": "val/acc"}
    config = ["--config", str(write_grid(tmp_path, seeds=[0], select=select)), "--root", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"2 of 8 runs failed and are not in the report \(threshold/lr=0.003,L=16"):
        compare.main([*config, "--keep_going"])
    assert "threshold/lr=0.003,L=32/seed0] failed, going on (--keep_going)" in capsys.readouterr().out
    rows = read_csv(tmp_path / "out" / "results.csv")
    assert [(row["variant"], row["L"], row["lr (chosen)"]) for row in rows] == [
        ("softmax", "16", "0.001"), ("softmax", "32", "0.001"), ("threshold", "16", "0.001"), ("threshold", "32", "0.001")
    ]


def test_missing_key_metric_is_reported_after_the_first_run(tmp_path, capsys, monkeypatch):
    seen_before_second: list[str] = []
    calls: list = []
    launch = fake_fit({"val/loss": 1.0}, calls)

    def recording_launch(*args):
        if calls:  # the second run: the first one's warning is out already
            seen_before_second.append(capsys.readouterr().err)
        launch(*args)

    monkeypatch.setattr(runner, "launch", recording_launch)
    config = str(write_comparison(tmp_path, seeds=[0]))
    compare.main(["--config", config, "--root", str(tmp_path / "out")])
    assert "run softmax/seed0 did not log key_metric 'val/acc'" in seen_before_second[0]
    assert (tmp_path / "out" / "results.png").stat().st_size > 0


def test_list_and_only(tmp_path, capsys, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.5}, calls))
    config = ["--config", str(write_grid(tmp_path)), "--root", str(tmp_path / "out")]
    compare.main([*config, "--only", "5"])
    assert [run for _, run, _ in calls] == ["threshold/lr=0.003,L=16/seed0"]
    assert not (tmp_path / "out" / "results.md").exists()  # no report from a single run
    compare.main([*config, "--list"])
    lines = capsys.readouterr().out.splitlines()[-16:]
    assert lines[5] == "5\tthreshold/lr=0.003,L=16/seed0\tdone" and lines[0] == "0\tsoftmax/lr=0.001,L=16/seed0\tto run"
    with pytest.raises(ValueError, match="only: give a run number of --list, 0 to 15, got 16"):
        compare.main([*config, "--only", "16"])


def test_device_slots(monkeypatch):
    monkeypatch.setattr(runner, "visible_gpus", lambda: ["0", "1", "2", "3"])
    assert runner.device_slots(2, 2) == [{"CUDA_VISIBLE_DEVICES": d} for d in ("0,1", "0,1", "2,3", "2,3")]
    assert runner.device_slots(1, 1) == [{"CUDA_VISIBLE_DEVICES": str(d)} for d in range(4)]
    with pytest.raises(ValueError, match="devices_per_run: 8 GPUs per run, but 4 are visible"):
        runner.device_slots(1, 8)
    monkeypatch.setattr(runner, "visible_gpus", lambda: [])
    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: set(range(8)))  # the cores this process may use
    assert runner.device_slots(1, 1) == [{}] and runner.device_slots(4, 1) == [{"OMP_NUM_THREADS": "2"}] * 4


def test_ctrl_c_terminates_the_runs_and_exits_130(tmp_path):
    """A comparison in a process of its own, whose run would sleep a minute; Ctrl-C (SIGINT to that
    process, as a terminal sends it) stops the run and the comparison, with one line and status 130. In a
    process of its own because in CI, inside a pytest worker, the interrupt sometimes never reached the
    comparison's main thread (both runs slept out their minute), cause not found."""
    config = write_comparison(tmp_path, seeds=[0])
    script = textwrap.dedent(
        f"""
        import sys
        from lit_thresh import compare
        from lit_thresh.compare import runner

        def sleeping_launch(subcommand, args, log, run, env, prefix):
            process = runner.PROCESSES.start([sys.executable, "-c", "import time; time.sleep(60)"], env)
            print("started", flush=True)
            process.wait()
            runner.PROCESSES.finished(process)
            print("returncode", process.returncode, flush=True)
            raise runner.Interrupted

        runner.launch = sleeping_launch
        compare.main(["--config", {str(config)!r}, "--root", {str(tmp_path / "out")!r}])
        """
    )
    begin = time.monotonic()
    comparison = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
    try:
        lines = []
        for line in comparison.stdout:  # up to the run's start
            lines.append(line)
            if line.startswith("started"):
                break
        assert lines and lines[-1].startswith("started"), "".join(lines) + comparison.stderr.read()
        comparison.send_signal(signal.SIGINT)
        out, err = comparison.communicate(timeout=30)
    finally:
        comparison.kill()
    assert comparison.returncode == 130 and time.monotonic() - begin < 30
    assert out.splitlines().count("started") == 0 and f"returncode {-signal.SIGTERM}" in out.splitlines()
    assert err.strip().splitlines()[-1] == (
        "lit_thresh compare: interrupted (1 run(s) stopped); finished runs are kept, run the command again to resume"
    )


def test_arguments_after_double_dash_reach_every_run(tmp_path):
    cfg = plan.parse(["--config", str(write_comparison(tmp_path)), "--", "--data.init_args.batch_size=8"])
    assert cfg.root == str(Path("comparisons") / "tiny_compare")
    for run in plan.expand(cfg):
        args = plan.run_args(cfg, run)
        assert args[0] == f"--config={QUICKSTART.resolve()}" and args[-1] == "--data.init_args.batch_size=8"
    softmax, threshold = plan.expand(cfg)[:2]
    assert "--model.config.attention=lit_thresh.attention.SoftmaxAttention" in plan.run_args(cfg, softmax)
    assert f"--config={(tmp_path / 'beta.yaml').resolve()}" in plan.run_args(cfg, threshold)


def test_duplicate_keys_are_refused(tmp_path):
    path = write_comparison(tmp_path)
    text = path.read_text().replace("variants:\n", "variants:\n  threshold: {}\n")
    path.write_text(text)
    with pytest.raises(ValueError, match=r"tiny_compare.yaml, line \d+: 'threshold' is given twice"):
        plan.parse(["--config", str(path)])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"variants": {"a/b": {}}}, "variants: name 'a/b' must be letters"),
        ({"variants": {}}, "variants: give at least one variant"),
        ({"variants": {"a": {"--model.d_model": 8}}}, "variants.a: override keys are dotted options"),
        ({"seeds": []}, "seeds: give at least one seed"),
        ({"seeds": [1, 1]}, "seeds: each seed once"),
        ({"key_metric": "val/ppl"}, "key_metric 'val/ppl' is not matched by any of metrics"),
        ({"grid": {"a.b": []}}, "grid.a.b: give at least one value"),
        ({"grid": {"a.b": [0.001, 1.0e-3]}}, "grid.a.b: value 0.001 is given twice"),
        ({"grid": {"a.b": [[1, 2]]}}, r"grid.a.b: value \[1, 2\] cannot name a folder; use a labelled axis"),
        ({"grid": {"a.b": ["x/y"]}}, "grid.a.b: value 'x/y' cannot name a folder"),
        ({"grid": {"L": {"6 4": {"a.b": 1}}}}, "grid.L: give label -> {dotted option: value}, got '6 4'"),
        ({"grid": {"a.b": [1]}, "select": {"over": ["b"], "by": "x"}}, r"select.over: give grid axes \(\['a.b'\]\)"),
        ({"grid": {"a.b": [1]}, "plot": {"x": "c"}}, "plot.x: give a grid axis not in select.over"),
        ({"runs_per_device": 0}, "runs_per_device: give a number >= 1, got 0"),
    ],
)
def test_bad_comparison_is_a_clear_error(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        plan.parse(["--config", str(write_comparison(tmp_path, **fields))])


@pytest.mark.parametrize(
    ("fields", "key"), [({"variants": {"a": 3}}, "variants"), ({"base": ["missing.yaml"]}, "base")]
)
def test_bad_types_are_parse_errors(tmp_path, capsys, fields, key):
    with pytest.raises(SystemExit):
        plan.parse(["--config", str(write_comparison(tmp_path, **fields))])
    assert f'Parser key "{key}"' in capsys.readouterr().err


def test_zoology_grid_parses_to_its_288_runs():
    cfg = plan.parse(["--config", str(ZOOLOGY)])
    runs = plan.expand(cfg)
    assert len(runs) == 4 * 4 * 2 * 3 * 3 and len({run.name for run in runs}) == len(runs)
    assert runs[0].name == "softmax/L=64,model=zoology,d_model=64,lr=0.0003/seed0"
    args = plan.run_args(cfg, runs[-1])
    assert "--data.init_args.train=[{num_examples: 100000, num_kv_pairs: 64, seq_len: 512}]" in args
    assert args[-4:] == ["--model.config.positional=none", "--model.config.key_conv=2", "--model.config.d_model=256",
                         "--model.optimizer.init_args.lr=0.003"]
