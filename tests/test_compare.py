"""``lit_thresh compare``: a tiny comparison (2 variants x 2 seeds) through the installed command on CPU,
its rerun, and the aggregation, event reading, plot and argument checks on their own."""

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.tensorboard import SummaryWriter

from lit_thresh import compare
from tests.test_cli import QUICKSTART, run_cli, scalars

RUNS = [(variant, seed) for seed in (0, 1) for variant in ("softmax", "threshold")]
# the quickstart shrunk to one epoch of 2 steps
TINY = {
    "trainer": {"accelerator": "cpu", "max_epochs": 1, "enable_progress_bar": False},
    "data": {
        "init_args": {
            "train": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 32}],
            "val": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 32}],
            "batch_size": 16,
        }
    },
}


def write_comparison(folder: Path, **fields) -> Path:
    """A comparison YAML in folder over the tiny quickstart: softmax by an override, threshold with
    beta 0.5 by an extra config file."""
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    (folder / "beta.yaml").write_text("model:\n  attention:\n    init_args:\n      beta: 0.5\n")
    comparison = {
        "base": [str(QUICKSTART), "tiny.yaml"],
        "variants": {"softmax": {"model.attention": "lit_thresh.attention.SoftmaxAttention"}, "threshold": ["beta.yaml"]},
        "seeds": [0, 1],
        "metrics": ["val/acc", "val/loss"],
        "test": False,
        **fields,
    }
    path = folder / "tiny_compare.yaml"
    path.write_text(yaml.safe_dump(comparison))
    return path


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, str]:
    """The tiny comparison run once by the installed command; returns its folder and output."""
    folder = tmp_path_factory.mktemp("compare")
    result = run_cli("compare", "--config", str(write_comparison(folder)), cwd=folder)
    return folder, result.stdout


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_compare_writes_runs_table_csv_and_plot(compared):
    folder, stdout = compared
    root = folder / "comparisons" / "tiny_compare"
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("*/seed*")) == sorted(
        f"{variant}/seed{seed}" for variant, seed in RUNS
    )
    final_loss: dict[str, list[float]] = {"softmax": [], "threshold": []}
    for variant, seed in RUNS:
        run = root / variant / f"seed{seed}"
        assert len(list(run.glob("events.out.tfevents.*"))) == 1  # one TensorBoard run, fit only
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["seed_everything"] == seed
        attention = config["model"]["attention"]
        assert attention["class_path"].endswith("SoftmaxAttention" if variant == "softmax" else "ThresholdAttention")
        if variant == "threshold":
            assert attention["init_args"]["beta"] == 0.5
        results = json.loads((run / compare.RESULTS).read_text())
        assert (results["eval_length"], results["eval_pairs"]) == (32, 4)
        final_loss[variant].append(scalars(run)["val/loss"][-1])

    rows = read_csv(root / "results.csv")
    assert [row["variant"] for row in rows] == ["softmax", "threshold"]
    for row in rows:
        assert row["seeds"] == "2"
        numbers = {key: float(row[key]) for key in ("n_params mean", "val/acc mean", "val/acc std", "val/loss std")}
        assert all(math.isfinite(value) for value in numbers.values())
        assert numbers["n_params mean"] > 1000 and 0 <= numbers["val/acc mean"] <= 1
        assert float(row["val/loss mean"]) == pytest.approx(sum(final_loss[row["variant"]]) / 2, rel=1e-6)

    table = (root / "results.md").read_text().splitlines()
    assert table[0].startswith("| variant | seeds | params | tokens/s | peak memory (GiB) | val/acc | val/loss |")
    assert [line.split(" | ")[0] for line in table[2:]] == ["| softmax", "| threshold"]
    assert all(" ± " in line for line in table[2:])
    assert table[2] in stdout  # printed at the end
    assert (root / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_runs(compared, capsys, monkeypatch):
    folder, _ = compared
    root = folder / "comparisons" / "tiny_compare"
    files = [p for p in root.glob("*/seed*/**/*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in files}
    csv_before = (root / "results.csv").read_text()
    monkeypatch.chdir(folder)
    compare.main(["--config", str(folder / "tiny_compare.yaml")])
    out = capsys.readouterr().out
    assert out.count("done before, skipped") == len(RUNS) and "lit_thresh fit" not in out
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert (root / "results.csv").read_text() == csv_before


def test_unfinished_run_starts_over_and_a_failure_names_it(compared, tmp_path, monkeypatch):
    folder, _ = compared
    shutil.copytree(folder / "comparisons", tmp_path / "comparisons")
    unfinished = tmp_path / "comparisons" / "tiny_compare" / "threshold" / "seed1"
    (unfinished / compare.RESULTS).unlink()
    launched = []

    def failing_launch(subcommand, args, log, run):
        launched.append((subcommand, run, sorted(p.name for p in log.parent.iterdir())))
        raise compare.RunFailed(f"run {run}: `lit_thresh {subcommand}` exited with code 1; see {log}")

    monkeypatch.setattr(compare, "launch", failing_launch)
    root = ["--root", str(tmp_path / "comparisons" / "tiny_compare")]
    with pytest.raises(SystemExit, match=r"threshold/seed1.*exited with code 1; see .*threshold/seed1/fit\.log"):
        compare.main(["--config", str(folder / "tiny_compare.yaml"), *root])
    assert launched == [("fit", "threshold/seed1", [])]  # only the unfinished run, in a fresh folder


def fake_results(rng: torch.Generator, seeds: int, tags: list[str]) -> list[dict]:
    return [{"metrics": {tag: torch.rand((), generator=rng).item() for tag in tags}} for _ in range(seeds)]


def test_table_and_csv_are_mean_and_std_over_seeds(tmp_path):
    rng = torch.Generator().manual_seed(0)
    results = {
        "a": fake_results(rng, 3, ["val/acc", "test/len64_n4/acc", "test/len128_n4/acc", "n_params"]),
        "b": fake_results(rng, 1, ["val/acc", "n_params"]),
    }
    tags = compare.metric_tags(results, ["val/*", "test/*"])
    assert tags == ["val/acc", "test/len64_n4/acc", "test/len128_n4/acc"]  # pattern order, then natural order

    compare.write_csv(tmp_path / "t.csv", results, tags)
    rows = {row["variant"]: row for row in read_csv(tmp_path / "t.csv")}
    values = torch.tensor([r["metrics"]["val/acc"] for r in results["a"]], dtype=torch.float64)
    assert float(rows["a"]["val/acc mean"]) == pytest.approx(values.mean().item(), rel=1e-12)
    assert float(rows["a"]["val/acc std"]) == pytest.approx(values.std().item(), rel=1e-12)  # sample std
    assert float(rows["b"]["val/acc mean"]) == pytest.approx(results["b"][0]["metrics"]["val/acc"])
    assert rows["b"]["val/acc std"] == "" and rows["b"]["test/len64_n4/acc mean"] == ""  # one seed; not logged

    lines = compare.markdown_table(results, tags).splitlines()
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
    metrics = compare.final_scalars(tmp_path)
    # the last value of every tag, from both event files, and the best validation accuracy of the run
    assert metrics == pytest.approx(final | {"best/val/acc": max(logged["val/acc"])})

    result = {"metrics": metrics, "eval_length": 32, "eval_pairs": 4}
    assert compare.length_points(result, "acc") == {
        ("N = 4", 32): metrics["test/acc"],
        ("N = 4", 64): metrics["test/len64_n4/acc"],
        ("N ∝ length (4 at 32)", 32): metrics["test/acc"],
        ("N ∝ length (4 at 32)", 64): metrics["test/len64_n8/acc"],
    }
    figure = compare.plot(tmp_path / "plot.png", {"v": [result, result]}, "val/acc")
    assert len(figure.axes) == 3 and (tmp_path / "plot.png").stat().st_size > 0
    with pytest.raises(ValueError, match="key_metric 'val/loss' was not logged"):
        compare.plot(tmp_path / "plot.png", {"v": [result]}, "val/loss")


def test_best_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(compare.RunFailed, match="no checkpoint to test"):
        compare.best_checkpoint(tmp_path)
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").touch()
    assert compare.best_checkpoint(tmp_path) == checkpoints / "last.ckpt"
    (checkpoints / "epoch=3-step=40.ckpt").touch()
    assert compare.best_checkpoint(tmp_path) == checkpoints / "epoch=3-step=40.ckpt"


def test_arguments_after_double_dash_reach_every_run(tmp_path):
    cfg = compare.parse(["--config", str(write_comparison(tmp_path)), "--", "--data.init_args.batch_size=8"])
    assert cfg.root == str(Path("comparisons") / "tiny_compare")
    for variant in cfg.variants:
        args = compare.variant_args(cfg, variant)
        assert args[0] == f"--config={QUICKSTART.resolve()}" and args[-1] == "--data.init_args.batch_size=8"
    assert "--model.attention=lit_thresh.attention.SoftmaxAttention" in compare.variant_args(cfg, "softmax")
    assert f"--config={(tmp_path / 'beta.yaml').resolve()}" in compare.variant_args(cfg, "threshold")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"variants": {"a": 3}}, 'Parser key "variants"'),
        ({"variants": {"a/b": {}}}, "variants: name 'a/b' must be letters"),
        ({"variants": {}}, "variants: give at least one variant"),
        ({"variants": {"a": {"--model.d_model": 8}}}, "variants.a: override keys are dotted options"),
        ({"seeds": []}, "seeds: give at least one seed"),
        ({"seeds": [1, 1]}, "seeds: each seed once"),
        ({"key_metric": "val/ppl"}, "key_metric 'val/ppl' is not matched by any of metrics"),
        ({"base": ["missing.yaml"]}, 'Parser key "base"'),
    ],
)
def test_bad_comparison_is_a_clear_error(tmp_path, capsys, fields, message):
    with pytest.raises(SystemExit):
        compare.parse(["--config", str(write_comparison(tmp_path, **fields))])
    assert message in capsys.readouterr().err
