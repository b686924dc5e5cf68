"""``lit_thresh compare``'s runs on disk: an unfinished run resumes from its last.ckpt (a real tiny fit on CPU,
interrupted after its first epoch), a finished run runs again when its config contents change (not their
comments), a run that another compare or a fit holds is left alone, the best of several kept checkpoints is
tested, --report_only, and the results read back from a resumed run's events with their diagnostics."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from lit_thresh import compare
from lit_thresh.compare import fingerprint, plan, results, runner, state
from lit_thresh.resume import RunLock
from tests.test_cli import scalars
from tests.test_compare import TINY_L, fake_fit, write_comparison

SOFTMAX = {"softmax": {"model.config.attention": "lit_thresh.attention.SoftmaxAttention"}}


def save_checkpoint(path: Path, step: int, best: str | None = None, monitor: str | None = "val/acc") -> None:
    """A small Lightning-like checkpoint at `step` whose ModelCheckpoint state names `best` (a path) best."""
    path.parent.mkdir(parents=True, exist_ok=True)
    callbacks = {}
    if best is not None:
        key = f"ModelCheckpoint{{'monitor': {monitor!r}, 'mode': 'max'}}"
        callbacks[key] = {"monitor": monitor, "best_model_path": f"/elsewhere/{best}",
                          "best_model_score": torch.tensor(0.5)}
        callbacks["StepCheckpoint{'monitor': None}"] = {"monitor": None, "best_model_path": "/elsewhere/last.ckpt"}
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": step, "callbacks": callbacks}, path)


def test_best_checkpoint_is_the_one_the_newest_state_names(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(state.RunFailed, match="no checkpoint to test"):
        state.best_checkpoint(tmp_path)
    save_checkpoint(checkpoints / "last.ckpt", 8)
    assert state.best_checkpoint(tmp_path) == checkpoints / "last.ckpt"  # nothing else kept
    save_checkpoint(checkpoints / "epoch=0-step=2.ckpt", 2)
    assert state.best_checkpoint(tmp_path) == checkpoints / "epoch=0-step=2.ckpt"  # save_top_k=1: the one kept
    # save_top_k=3: the newest checkpoint's state (last.ckpt) names the best, not the latest or the first
    save_checkpoint(checkpoints / "epoch=1-step=4.ckpt", 4, best="epoch=0-step=2.ckpt")
    save_checkpoint(checkpoints / "epoch=2-step=6.ckpt", 6, best="epoch=1-step=4.ckpt")
    save_checkpoint(checkpoints / "last.ckpt", 8, best="epoch=1-step=4.ckpt")
    assert state.best_checkpoint(tmp_path) == checkpoints / "epoch=1-step=4.ckpt"
    (checkpoints / "last.ckpt").unlink()  # else the newest kept one's state
    assert state.best_checkpoint(tmp_path) == checkpoints / "epoch=1-step=4.ckpt"
    for step in (2, 4, 6):  # no state names one of them: refused, not guessed
        save_checkpoint(next(checkpoints.glob(f"*step={step}.ckpt")), step)
    with pytest.raises(state.RunFailed, match="3 checkpoints besides last.ckpt and no ModelCheckpoint state"):
        state.best_checkpoint(tmp_path)


def write_events(folder: Path, start: int, points: dict[str, list[tuple[int, float]]]) -> None:
    """An event file of `points` named as a process started at `start` (seconds) names it: files load in
    name order, which is start order."""
    writer = SummaryWriter(folder / "tmp")
    for tag, series in points.items():
        for step, value in series:
            writer.add_scalar(tag, value, step)
    writer.close()
    (written,) = (folder / "tmp").iterdir()
    written.rename(folder / f"events.out.tfevents.{start:010d}.host.1.0")
    (folder / "tmp").rmdir()


def test_final_scalars_of_a_resumed_run_and_its_diagnostics(tmp_path):
    """An interrupted fit logged steps 250-750, the resumed one (from the checkpoint at 500) 750 and 1000:
    its values replace the interrupted one's at 750. Diagnostics: means over layers and heads, NaN heads
    left out, at the last validation and at the best val/loss."""
    head = "diag/layer{}/head{}/{}"
    first = {"val/loss": [(250, 2.0), (500, 1.5), (750, 1.3)],
             head.format(0, 0, "zero_frac"): [(250, 0.1), (500, 0.2), (750, 0.9)],
             head.format(1, 2, "zero_frac"): [(250, 0.3), (500, 0.4), (750, 0.9)]}
    resumed = {"val/loss": [(750, 1.4), (1000, 1.45)],
               head.format(0, 0, "zero_frac"): [(750, 0.5), (1000, 0.6)],
               head.format(1, 2, "zero_frac"): [(750, 0.7), (1000, 0.8)],
               head.format(0, 0, "sink_mass"): [(750, 0.25), (1000, 0.35)],
               head.format(1, 2, "sink_mass"): [(750, math.nan), (1000, math.nan)],
               "diag/layer0/lambda": [(750, 0.2), (1000, 0.4)], "diag/layer1/lambda": [(750, 0.6), (1000, 0.8)]}
    write_events(tmp_path, 1_700_000_000, first)
    write_events(tmp_path, 1_700_000_100, resumed)
    metrics = results.final_scalars(tmp_path, "val/loss", "min")
    assert metrics["val/loss"] == pytest.approx(1.45)
    assert metrics["best/val/loss"] == pytest.approx(1.4)  # the interrupted fit's 1.3 at step 750 is superseded
    assert metrics["diag/zero_frac"] == pytest.approx((0.6 + 0.8) / 2)
    assert metrics["best/diag/zero_frac"] == pytest.approx((0.5 + 0.7) / 2)  # at step 750, the resumed values
    assert metrics["diag/sink_mass"] == pytest.approx(0.35) and metrics["best/diag/sink_mass"] == pytest.approx(0.25)
    assert metrics["diag/lambda"] == pytest.approx(0.6) and metrics["best/diag/lambda"] == pytest.approx(0.4)
    assert "best/diag/zero_frac" not in results.final_scalars(tmp_path)  # no monitor: no best validation
    assert results.final_scalars(tmp_path, "val/loss", "max")["best/diag/zero_frac"] == pytest.approx(0.2)  # 250
    # an epoch's end validation: Lightning logs it at the global step - 1, the diagnostics at the global step
    epochs = tmp_path / "epochs"
    write_events(epochs, 1_700_000_000, {"val/loss": [(249, 1.0), (499, 2.0)],
                                         head.format(0, 0, "zero_frac"): [(250, 0.3), (500, 0.6)]})
    assert results.final_scalars(epochs, "val/loss", "min")["best/diag/zero_frac"] == pytest.approx(0.3)


def test_config_contents_decide_not_paths_or_comments(tmp_path):
    base, data = tmp_path / "base.yaml", tmp_path / "data.yaml"
    base.write_text("data: data.yaml\nmodel: {lr: 0.1}\n")
    data.write_text("batch_size: 4\n")
    args = [f"--config={base}", "--trainer.max_steps=2"]
    parts = fingerprint.fingerprint(args)
    assert parts[1] == {"arg": "--trainer.max_steps=2"} and parts[0]["config"] == str(base)
    before = fingerprint.config_hash(parts)
    base.write_text("# a comment\nmodel:\n  lr: 0.1  # the same value\ndata: data.yaml\n")
    moved = tmp_path / "sub" / "base.yaml"
    moved.parent.mkdir()
    moved.write_text("data: ../data.yaml\nmodel: {lr: 0.1}\n")
    for same in ([f"--config={base}", "--trainer.max_steps=2"], ["--config", str(moved), "--trainer.max_steps=2"]):
        assert fingerprint.config_hash(fingerprint.fingerprint(same)) == before
    data.write_text("batch_size: 8\n")  # a file the config names
    after = fingerprint.fingerprint(args)
    assert fingerprint.config_hash(after) != before
    assert fingerprint.describe_change(parts, after) == f"the contents of {base} changed"
    other = fingerprint.fingerprint([f"--config={moved}", "--trainer.max_steps=3"])
    assert fingerprint.describe_change(parts, other) == (f"no longer given: {base}, --trainer.max_steps=2; "
                                                        f"newly given: {moved}, --trainer.max_steps=3")
    data.write_text("batch_size: [")
    with pytest.raises(ValueError, match="data.yaml: cannot read this config"):
        fingerprint.fingerprint(args)


def test_edited_config_contents_are_a_changed_run_and_edited_comments_are_not(tmp_path, capsys, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, calls))
    config = ["--config", str(write_comparison(tmp_path, seeds=[0])), "--root", str(tmp_path / "out")]
    compare.main(config)
    assert len(calls) == 2
    beta = tmp_path / "beta.yaml"
    beta.write_text("# beta of the threshold variant\n" + beta.read_text())
    capsys.readouterr()
    compare.main(config)
    assert len(calls) == 2 and capsys.readouterr().out.count("done before, skipped") == 2
    beta.write_text(beta.read_text().replace("0.5", "0.7"))
    compare.main(config)
    out = capsys.readouterr().out
    assert len(calls) == 2 and "[softmax/seed0] done before, skipped" in out
    assert (f"[threshold/seed0] warning: done before with another configuration (the contents of {beta} "
            "changed), skipped; --rerun") in out
    compare.main([*config, "--rerun"])
    out = capsys.readouterr().out
    assert [run for _, run, _ in calls[2:]] == ["threshold/seed0"]
    assert f"(the contents of {beta} changed): running it again (--rerun)" in out
    assert "starting over (finished with another configuration: the contents of" in out
    assert (tmp_path / "out" / "threshold" / "seed0.old-1" / "results.json").is_file()


def interrupted_fit(calls: list):
    """A stand-in for runner.launch: a fit that wrote last.ckpt at step 2, then was killed."""
    fit = fake_fit({"val/acc": 0.25}, calls)

    def launch(subcommand, args, log, run, env, prefix):
        fit(subcommand, args, log, run, env, prefix)
        save_checkpoint(log.parent / "checkpoints" / "last.ckpt", 2)
        raise runner.RunFailed(f"run {run}: `lit_thresh fit` exited with code -9; see {log}")

    return launch


def test_unfinished_run_resumes_unless_its_configuration_changed(tmp_path, capsys, monkeypatch):
    calls: list = []
    config = ["--config", str(write_comparison(tmp_path, seeds=[0], variants=SOFTMAX)), "--root", str(tmp_path / "out")]
    monkeypatch.setattr(runner, "launch", interrupted_fit(calls))
    with pytest.raises(SystemExit, match="exited with code -9"):
        compare.main(config)
    run_dir = tmp_path / "out" / "softmax" / "seed0"
    started = json.loads((run_dir / "started.json").read_text())
    assert started["args"] == calls[0][2][: len(started["args"])] and not (run_dir / "results.json").exists()

    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.5}, calls))
    compare.main(config)
    assert f"[softmax/seed0] unfinished: resuming it from {run_dir}/checkpoints/last.ckpt (step 2)" in (
        capsys.readouterr().out)
    assert calls[1][2][-2:] == [f"--ckpt_path={run_dir}/checkpoints/last.ckpt",
                                "--trainer.logger.init_args.purge_step=2"]
    result = json.loads((run_dir / "results.json").read_text())
    assert result["started"] == started["started"] and result["config_hash"] == started["config_hash"]
    assert not list(run_dir.parent.glob("seed0.old-*"))  # resumed in place

    (run_dir / "results.json").unlink()  # unfinished again, and now started with other arguments
    compare.main([*config, "--", "--trainer.max_epochs=3"])
    out = capsys.readouterr().out
    assert ("starting over (unfinished, started with another configuration: newly given: "
            "--trainer.max_epochs=3)") in out
    assert not any(arg.startswith("--ckpt_path") for arg in calls[2][2])
    assert (run_dir.parent / "seed0.old-1" / "checkpoints" / "last.ckpt").is_file()


def test_a_finished_fit_whose_test_was_lost_is_only_tested(tmp_path, capsys, monkeypatch):
    """A compare stopped during a run's test: the next one tests the fit's checkpoint and does not train again
    (which would change the fit: EarlyStopping's stop is not in the checkpoint)."""
    calls: list = []
    fit = fake_fit({"val/acc": 0.5}, calls)

    def test_killed(subcommand, args, log, run, env, prefix):
        if subcommand == "test":
            calls.append((subcommand, run, args))
            raise runner.RunFailed(f"run {run}: `lit_thresh test` exited with code -9; see {log}")
        fit(subcommand, args, log, run, env, prefix)
        save_checkpoint(log.parent / "checkpoints" / "last.ckpt", 4)

    config = ["--config", str(write_comparison(tmp_path, seeds=[0], variants=SOFTMAX, test=True)),
              "--root", str(tmp_path / "out")]
    monkeypatch.setattr(runner, "launch", test_killed)
    with pytest.raises(SystemExit, match="exited with code -9"):
        compare.main(config)
    run_dir = tmp_path / "out" / "softmax" / "seed0"
    assert [call[0] for call in calls] == ["fit", "test"] and not (run_dir / "results.json").exists()

    calls.clear()
    monkeypatch.setattr(runner, "launch", lambda subcommand, args, log, run, env, prefix: calls.append(subcommand))
    compare.main(config)
    assert calls == ["test"]
    assert "[softmax/seed0] fitted before: testing it" in capsys.readouterr().out
    result = json.loads((run_dir / "results.json").read_text())
    assert result["metrics"]["val/acc"] == 0.5 and "fitted" not in result
    assert not list(run_dir.parent.glob("seed0.old-*"))


def test_a_run_another_compare_holds_is_left_alone(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, calls))
    root = tmp_path / "out"
    config = ["--config", str(write_comparison(tmp_path, seeds=[0])), "--root", str(root)]
    unfinished = root / "threshold" / "seed0"
    unfinished.mkdir(parents=True)
    (unfinished / "fit.log").write_text("a live run\n")
    lock = RunLock(root / state.LOCKS / "threshold" / "seed0")  # as the other compare holds it
    lock.acquire()
    try:
        with pytest.raises(SystemExit, match=r"run threshold/seed0: another lit_thresh compare is running it \(it "
                                             r"holds .*\.compare_locks/threshold/seed0/\.lit_thresh\.lock\)"):
            compare.main([*config, "--rerun", "--keep_going"])
        assert [run for _, run, _ in calls] == ["softmax/seed0"]  # the other run went on (--keep_going)
        assert (unfinished / "fit.log").read_text() == "a live run\n" and not list(root.glob("threshold/*.old-*"))
    finally:
        lock.release()
    compare.main(config)  # once that compare is done
    assert [run for _, run, _ in calls] == ["softmax/seed0", "threshold/seed0"]


def test_a_folder_a_fit_still_writes_into_is_not_moved(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, calls))
    root = tmp_path / "out"
    live = root / "softmax" / "seed0"
    lock = RunLock(live)  # a fit started by hand into the run's folder, still running
    lock.acquire()
    try:
        config = ["--config", str(write_comparison(tmp_path, seeds=[0], variants=SOFTMAX)), "--root", str(root)]
        with pytest.raises(SystemExit, match=r"run softmax/seed0: a fit is still writing into .*softmax/seed0"):
            compare.main(config)
        assert not calls and live.is_dir() and not list(root.glob("softmax/*.old-*"))
    finally:
        lock.release()


def test_report_only_reports_the_finished_runs_and_runs_nothing(tmp_path, capsys, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "launch", fake_fit({"val/acc": 0.25}, calls))
    root = tmp_path / "out"
    config = ["--config", str(write_comparison(tmp_path, seeds=[0])), "--root", str(root)]
    with pytest.raises(SystemExit, match="no run of 2 is finished under .*out: nothing to report"):
        compare.main([*config, "--report_only"])
    compare.main(config)
    (root / "threshold" / "seed0" / "results.json").unlink()
    (root / "results.md").unlink()
    capsys.readouterr()
    compare.main([*config, "--report_only"])
    out = capsys.readouterr().out
    assert len(calls) == 2 and "the report of the 1 finished runs of 2 (--report_only)" in out
    table = (root / "results.md").read_text()
    assert "| softmax |" in table and "| threshold |" not in table and table in out


def val_steps(path: Path) -> list[int]:
    """The steps of val/loss in one event file."""
    events = EventAccumulator(str(path))
    events.Reload()
    return [event.step for event in events.Scalars("val/loss")] if "val/loss" in events.Tags()["scalars"] else []


@pytest.mark.slow
def test_a_killed_fit_resumes_from_its_last_checkpoint_and_the_best_of_two_is_tested(tmp_path, capsys, monkeypatch):
    """A real tiny fit (CPU) of 3 epochs of 2 steps, save_top_k 2, killed after 4 steps (it stops at
    max_steps 4, having validated at step 2, and counts as killed); the next compare resumes it from step 4
    to 6, then tests the checkpoint of the best val/acc."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the runs take the PyTorch paths
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tiny_data = [f"--{key}={plan.cli_value(value)}" for key, value in TINY_L.items()]  # 2 steps an epoch
    comparison = write_comparison(tmp_path, seeds=[0], variants=SOFTMAX, test=True,
                                  extra_args=[*tiny_data, "--trainer.max_epochs=3", "--checkpoint.save_top_k=2"])
    config = ["--config", str(comparison), "--root", str(tmp_path / "out")]
    real_launch = runner.launch

    def killed_after_step_4(subcommand, args, log, run, env, prefix):
        real_launch(subcommand, [*args, "--trainer.max_steps=4"], log, run, env, prefix)
        raise runner.RunFailed(f"run {run}: `lit_thresh fit` exited with code -9; see {log}")

    monkeypatch.setattr(runner, "launch", killed_after_step_4)
    with pytest.raises(SystemExit, match="exited with code -9"):
        compare.main(config)
    run_dir = tmp_path / "out" / "softmax" / "seed0"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not (run_dir / "results.json").exists()
    (killed,) = run_dir.glob("events.out.tfevents.*")
    assert val_steps(killed) and max(val_steps(killed)) <= 4

    monkeypatch.setattr(runner, "launch", real_launch)
    compare.main(config)
    assert f"unfinished: resuming it from {run_dir}/checkpoints/last.ckpt (step 4)" in capsys.readouterr().out
    fit_log = (run_dir / "fit.log").read_text()
    assert f"--ckpt_path={run_dir}/checkpoints/last.ckpt --trainer.logger.init_args.purge_step=4" in fit_log
    events = sorted(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 3 and events[0] == killed  # the killed fit's, the resumed fit's, the test's
    assert val_steps(events[1]) and min(val_steps(events[1])) > 4  # continued, not started over
    result = json.loads((run_dir / "results.json").read_text())
    logged = scalars(run_dir)
    assert result["metrics"]["val/loss"] == pytest.approx(logged["val/loss"][-1])
    kept = list((run_dir / "checkpoints").glob("epoch=*.ckpt"))
    assert len(kept) == 2 and state.best_checkpoint(run_dir) in kept  # save_top_k 2: the state's best is tested
    assert f"--ckpt_path={state.best_checkpoint(run_dir)}" in (run_dir / "test.log").read_text()
    assert "test/acc" in result["metrics"] and "best/diag/sink_mass" in result["metrics"]


def out_of_memory_first(fit, oom_left: dict[str, int], error: str, calls: list | None = None):
    """A stand-in for runner.launch: each run named in oom_left fails that many times first, its log saying
    `error` (recorded in `calls` as (subcommand, run, CUDA_VISIBLE_DEVICES) when given), then `fit` runs."""

    def launch(subcommand, args, log, run, env, prefix):
        if oom_left.get(run, 0) > 0:
            oom_left[run] -= 1
            if calls is not None:
                calls.append((subcommand, run, env["CUDA_VISIBLE_DEVICES"]))
            with log.open("a") as out:
                out.write(error + "\n")
            raise runner.RunFailed(f"run {run}: `lit_thresh {subcommand}` exited with code 1; see {log}")
        fit(subcommand, args, log, run, env, prefix)

    return launch


@pytest.mark.parametrize("error", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "torch.AcceleratorError: CUDA error: out of memory",  # CUDA's own, e.g. at a context's creation
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
])
def test_a_run_out_of_gpu_memory_while_sharing_its_gpu_runs_again_alone(tmp_path, capsys, monkeypatch, error):
    """4 runs, 2 at a time on one GPU: threshold/seed0 runs out of memory on its first fit (each of the
    errors an H200 shared by 36 runs gave); it is no failure but runs again after the others. Run alone,
    the same error is a failure like any other."""
    calls: list = []
    fit = fake_fit({"val/acc": 0.5}, calls)
    oom_left = {"threshold/seed0": 1}

    monkeypatch.setattr(runner, "launch", out_of_memory_first(fit, oom_left, error, calls))
    monkeypatch.setattr(runner, "visible_gpus", lambda: ["0"])
    config = ["--config", str(write_comparison(tmp_path)), "--root", str(tmp_path / "out")]
    compare.main([*config, "--runs_per_device", "2"])
    order = [call[1] for call in calls]
    assert sorted(order) == sorted(["softmax/seed0", "softmax/seed1", "threshold/seed1"] + ["threshold/seed0"] * 2)
    assert order[-1] == "threshold/seed0" and calls[order.index("threshold/seed0")][2] == "0"
    assert ("[threshold/seed0] out of GPU memory with other runs on its GPU: it runs again once they are done, with "
            "fewer runs per GPU") in capsys.readouterr().out
    assert (tmp_path / "out" / "threshold" / "seed0" / "results.json").is_file()

    # alone on its GPU: a failure, named as any other
    shutil.rmtree(tmp_path / "out" / "threshold" / "seed0")
    oom_left["threshold/seed0"] = 1
    with pytest.raises(SystemExit, match=r"threshold/seed0: `lit_thresh fit` exited with code 1"):
        compare.main([*config, "--runs_per_device", "1"])


def test_runs_out_of_memory_run_again_together_with_half_as_many_per_gpu(tmp_path, monkeypatch):
    """4 runs, 4 at a time on one GPU: two run out of memory on their first fit. They run again after the
    others, 2 at a time (not one by one); a third attempt would have had one slot."""
    calls: list = []
    fit = fake_fit({"val/acc": 0.5}, calls)
    oom_left = {"threshold/seed0": 1, "softmax/seed1": 1}

    slot_counts: list[int] = []
    run_all = runner.run_all

    def counted(cfg, runs, check, slots):
        slot_counts.append(len(slots))
        return run_all(cfg, runs, check, slots)

    error = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    monkeypatch.setattr(runner, "launch", out_of_memory_first(fit, oom_left, error))
    monkeypatch.setattr(runner, "run_all", counted)
    monkeypatch.setattr(runner, "visible_gpus", lambda: ["0"])
    compare.main(["--config", str(write_comparison(tmp_path)), "--root", str(tmp_path / "out"), "--runs_per_device", "4"])
    assert slot_counts == [2]  # the retry's run_all (compare.main calls the first by its own name), 2 slots of 4
    fits = [call[1] for call in calls if call[0] == "fit"]  # the attempts out of memory did not get to fit
    assert sorted(fits[-2:]) == ["softmax/seed1", "threshold/seed0"] and len(fits) == 4  # the retries, last
    assert len(list((tmp_path / "out").glob("*/seed*/results.json"))) == 4


def test_fewer_slots_halves_each_device_group_down_to_one():
    gpu = lambda i: {"CUDA_VISIBLE_DEVICES": str(i)}  # noqa: E731
    assert runner._fewer([gpu(0)] * 4 + [gpu(1)] * 4) == [gpu(0)] * 2 + [gpu(1)] * 2
    assert runner._fewer([gpu(0)] * 3 + [gpu(1)] * 3) == [gpu(0), gpu(1)]
    assert runner._fewer([gpu(0), gpu(1)]) == [gpu(0), gpu(1)]
    assert runner._fewer([{}] * 5) == [{}] * 2  # CPU runs: no retry, but the rule is the same


def test_out_of_memory_counts_only_in_what_the_logs_got_since(tmp_path):
    """An out-of-memory line that an earlier attempt left in a log does not make a later failure one."""
    (tmp_path / "fit.log").write_text("torch.OutOfMemoryError: CUDA out of memory.\n")
    sizes = runner._log_sizes(tmp_path)
    assert sizes == {"fit.log": 44, "test.log": 0} and not runner._ran_out_of_memory(tmp_path, sizes)
    with (tmp_path / "fit.log").open("a") as log:
        log.write("ValueError: something else\n")
    assert not runner._ran_out_of_memory(tmp_path, sizes)
    (tmp_path / "test.log").write_text("RuntimeError: CUDA out of memory. Tried to allocate 1 GiB\n")
    assert runner._ran_out_of_memory(tmp_path, sizes)
