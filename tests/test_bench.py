"""The benchmark's argument parsing, table and CSV on made-up timings (no GPU), and its error without CUDA."""

from __future__ import annotations

import csv
import math
import re
from dataclasses import replace

import pytest
import torch

from lit_thresh import bench
from lit_thresh.bench import (HostResult, Result, causal_fwd_flops, derived, format_host, format_table, parse_args,
                              write_csv)


def _results() -> list[Result]:
    point = dict(dtype="bfloat16", head_dim=128, seq_len=4096, batch=4, heads=16)
    return [
        Result("sdpa cudnn", **point, fwd_ms=1.0, fwd_bwd_ms=3.0, fwd_mib=32.0, fwd_bwd_mib=128.0),
        Result("sdpa flash", **point, fwd_ms=1.25, fwd_bwd_ms=4.0, fwd_mib=32.0, fwd_bwd_mib=128.0),
        Result("threshold p=2", **point, fwd_ms=0.8, fwd_bwd_ms=6.0, fwd_mib=32.0, fwd_bwd_mib=128.0),
        Result("differential fused p=2", **point, fwd_ms=2.0, fwd_bwd_ms=8.0, maps=2),
        Result("sdpa cudnn", **{**point, "seq_len": 1024, "batch": 16}, note="failed: not supported"),
    ]


def test_defaults_are_the_whole_grid():
    args = parse_args([])
    assert args.head_dims == [64, 128] and args.seq_lens == [1024, 2048, 4096, 8192, 16384]
    assert args.dtypes == ["bfloat16", "float16"] and args.tokens == 16384 and args.heads == 16
    assert args.zero_fractions == [0.5, 0.9, 0.99] and not args.quick and not args.sweep and args.csv is None
    assert args.sweep_ops == ["single", "differential"]


def test_restricted_grid():
    args = parse_args(["--head-dims", "128", "--seq-lens", "4096", "--dtypes", "bfloat16", "--quick", "--zero-fractions"])
    assert (args.head_dims, args.seq_lens, args.dtypes, args.quick, args.zero_fractions) == ([128], [4096], ["bfloat16"], True, [])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-lens", "3000"], "each T must divide --tokens"),
        (["--head-dims", "300"], r"each D must be in \[1, 256\]"),
        (["--head-dims", "0"], "must be a positive integer"),
        (["--dtypes", "float32"], "invalid choice"),
        (["--repeats", "0"], "must be a positive integer"),
        (["--zero-fractions", "1.5"], r"each must be in \[0, 1\)"),
        (["--zero-fractions", "1.0"], r"each must be in \[0, 1\)"),
        (["--zero-fractions", "-0.1"], r"each must be in \[0, 1\)"),
        (["--sweep-ops", "fused"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_derived_columns():
    rows = {(r["variant"], r["seq_len"]): r for r in derived(_results())}
    ours = rows[("threshold p=2", 4096)]
    flops = causal_fwd_flops(4, 16, 4096, 128)
    assert flops == 2 * 4 * 16 * 4096**2 * 128
    assert ours["fwd_tflops"] == pytest.approx(flops / 0.8e-3 / 1e12)
    assert ours["fwd_bwd_tflops"] == pytest.approx(3.5 * flops / 6.0e-3 / 1e12)
    assert ours["fwd_x_cudnn"] == pytest.approx(1.25) and ours["fwd_x_flash"] == pytest.approx(1.5625)
    assert ours["fwd_bwd_x_cudnn"] == pytest.approx(0.5) and ours["fwd_bwd_x_flash"] == pytest.approx(4.0 / 6.0)
    fused = rows[("differential fused p=2", 4096)]
    assert fused["fwd_tflops"] == pytest.approx(2 * flops / 2.0e-3 / 1e12)  # two maps
    assert math.isnan(rows[("sdpa cudnn", 1024)]["fwd_tflops"])  # not measured stays NaN


def test_table_has_one_line_per_result_and_dashes_for_missing():
    lines = format_table(_results()).splitlines()
    assert len(lines) == 1 + len(_results())
    assert lines[0].split()[:5] == ["dtype", "D", "T", "B", "variant"]
    ours = next(line for line in lines if "threshold p=2" in line)
    assert "0.800" in ours and "1.25" in ours and "6.000" in ours and "0.50" in ours
    failed = lines[-1]
    assert failed.count(" - ") >= 8 and failed.endswith("failed: not supported")


def test_csv_round_trip(tmp_path):
    path = tmp_path / "bench.csv"
    write_csv(str(path), _results(), [HostResult("threshold p=2 forward (no grad)", 14.5, 13.25, 17.75)])
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(_results()) + 1
    ours = next(r for r in rows if r["variant"] == "threshold p=2")
    assert float(ours["fwd_bwd_x_cudnn"]) == pytest.approx(0.5) and float(ours["fwd_bwd_mib"]) == 128.0
    assert rows[-1]["variant"] == "threshold p=2 forward (no grad)" and float(rows[-1]["host_us"]) == 14.5
    assert (float(rows[-1]["host_us_min"]), float(rows[-1]["host_us_max"])) == (13.25, 17.75)


def test_host_rows_print_the_median_and_range():
    text = format_host([HostResult("threshold p=2 forward (no grad)", 14.5, 13.25, 17.75)])
    assert "median [min - max]" in text.splitlines()[0]
    assert text.splitlines()[1].endswith(" 14.5 [13.2 - 17.8]")


def test_stubbed_launches_skip_the_kernels_and_restore_them():
    """host_overhead's 'no launch' rows: the op runs its Python and torch ops, forward and backward, with
    no Triton launch; the kernels are back afterwards."""
    from lit_thresh.ops import call_plans, threshold_attention, triton_launch

    kernels = (triton_launch._FWD, triton_launch._BWD_DKV, triton_launch._BWD_DQ)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)
    q, k, v = (torch.ones(1, 2, 8, 16, device=device, requires_grad=True) for _ in range(3))
    beta = torch.full((2,), 0.5, device=device, requires_grad=True)
    plans = call_plans._PLANS
    with bench.stubbed_launches():
        for _ in range(3):  # the third call planned, with plans of its own
            out = threshold_attention(q, k, v, beta, 2.0, backend="triton")
            out.backward(torch.ones_like(out))
        with torch.no_grad():
            threshold_attention(q, k, v, beta, 2.0, backend="triton")
        assert not {triton_launch._FWD, triton_launch._BWD_DKV, triton_launch._BWD_DQ} & set(kernels)
        assert call_plans._PLANS is not plans and len(call_plans._PLANS) == 1
    assert out.shape == (1, 2, 8, 16) and all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, beta))
    assert (triton_launch._FWD, triton_launch._BWD_DKV, triton_launch._BWD_DQ) == kernels
    assert call_plans._PLANS is plans


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on machines without CUDA")
def test_without_cuda_exits_with_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick"])
    assert exit_info.value.code == 2
    assert "the benchmark needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("op", ["", "diff "])
@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkv", "bwd_dq"])
def test_sweep_calls_run_the_config_given_for_one_kernel_and_the_defaults_for_the_others(monkeypatch, op, kernel):
    """The sweep of the single ('') and the differential ('diff ') op: each config list starts at the default
    (then skip_zero on it, then the swept tiles with and without TMA loads), and each call launches the kernel at
    the config given, the others at their defaults, computing what the default call computes."""
    from lit_thresh.ops import triton_differential, triton_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)
    defaults = (triton_differential.default_diff_configs if op else triton_launch.default_configs)(16, torch.float32)
    cfgs = bench._sweep_configs(op, kernel, 16, torch.float32, 24)
    assert cfgs[0] == getattr(defaults, kernel) and cfgs[1] == replace(cfgs[0], skip_zero=True)
    assert any(c.tma for c in cfgs) and not all(c.tma for c in cfgs)
    seen = []
    for name in ("triton_forward", "triton_backward", "diff_triton_forward", "diff_triton_backward"):
        module = triton_differential if name.startswith("diff") else triton_launch
        launch = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, launch=launch: seen.append(a[-1]) or launch(*a))
    x = bench._sweep_inputs(1, 2, 24, 16, torch.float32, device=device)
    cfg = triton_launch.BlockConfig(16, 16, 4, 1)
    got, want = (bench._sweep_call(op, kernel, c, x)() for c in (cfg, cfgs[0]))
    assert seen == [replace(defaults, **{kernel: cfg}), replace(defaults, **{kernel: cfgs[0]})]
    got, want = (out if isinstance(out, tuple) else (out,) for out in (got, want))
    assert len(got) == len(want) and all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))


def test_sweep_of_the_second_dkv_launch_only_where_the_default_has_one(monkeypatch):
    """bwd_dk2 (the differential op's dK2 in a second dK/dV launch) is swept where the default configs launch it,
    starting at its default tile; elsewhere it has no configs."""
    from lit_thresh.ops import triton_differential
    from lit_thresh.ops.triton_launch import BlockConfig, KernelConfigs

    assert triton_differential.default_diff_configs(16, torch.float32).bwd_dk2 is None
    assert bench._sweep_configs("diff ", "bwd_dk2", 16, torch.float32, 24) == []
    tile = BlockConfig(16, 16, 4, 1)
    monkeypatch.setattr(triton_differential, "default_diff_configs",
                        lambda d, dtype, large: KernelConfigs(tile, tile, tile, tile))
    cfgs = bench._sweep_configs("diff ", "bwd_dk2", 16, torch.float32, 24)
    assert cfgs[0] == tile and len(cfgs) == 2 + 2 * len(bench.DIFF_SWEEP["bwd_dk2"])


def test_the_differential_sweep_starts_at_the_defaults_of_a_call_of_its_size(monkeypatch):
    """Below the differential op's large-call size (triton_differential.large_call) a sweep starts from the small
    calls' default tiles, above it from the large calls'; the kernels not swept stay at the same defaults."""
    from lit_thresh.ops import triton_differential

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles (nothing is launched here)
    firsts = []
    for large in (False, True):
        defaults = triton_differential.default_diff_configs(64, torch.float16, large)
        firsts.append(bench._sweep_configs("diff ", "fwd", 64, torch.float16, 4096, large)[0])
        assert firsts[-1] == defaults.fwd
    assert firsts[0] != firsts[1]


def test_sweep_rows_are_told_from_the_table_rows():
    def is_sweep(variant: str) -> bool:
        return bench.is_sweep_row(Result(variant, "bfloat16", 64, 1024, 16, 16))

    assert is_sweep("fwd 128x64 w8 s3 tma") and is_sweep("bwd_dkv 32x64 w4 s2") and is_sweep("diff bwd_dq 64x32 w4 s3")
    assert is_sweep("diff bwd_dk2 64x128 w8 s2 tma")
    assert not is_sweep("differential fused p=2") and not is_sweep("threshold p=2") and not is_sweep("sdpa cudnn")


def test_sweep_times_every_config_of_both_ops_and_sorts_each_kernel(monkeypatch):
    """sweep()'s bookkeeping on CPU (the interpreter): compile errors by (op, kernel, config), a row per
    config labelled with its op and kernel, the default marked, each kernel's rows fastest first. Timing
    and the compile pool are stood in for (they need CUDA); one config fails to compile."""
    from concurrent.futures import Executor

    class InProcess(Executor):
        def __init__(self, **kwargs):
            pass

        def map(self, fn, tasks):
            return [fn(task) for task in tasks]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = bench._sweep_inputs
    monkeypatch.setattr(bench, "_sweep_inputs", lambda *a: inputs(*a, device=device))
    monkeypatch.setattr(bench, "ProcessPoolExecutor", InProcess)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    times = iter(range(1000, 0, -1))  # each config timed is faster than the one before

    def timed(fn, grads, timing):
        fn()  # the call runs (the interpreter), its time is made up
        return float(next(times))

    monkeypatch.setattr(bench, "_median_ms", timed)
    broken = bench.SWEPT_OPS["diff "]["bwd_dq"][0]
    real_call = bench._sweep_call

    def call(op, kernel, cfg, x, large=True):
        tile = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
        if (op, kernel, tile, cfg.tma) == ("diff ", "bwd_dq", broken, False):
            raise RuntimeError("out of resources: shared memory")
        return real_call(op, kernel, cfg, x, large)

    monkeypatch.setattr(bench, "_sweep_call", call)
    two_each = {op: {kernel: cfgs[:2] for kernel, cfgs in kernels.items()} for op, kernels in bench.SWEPT_OPS.items()}
    monkeypatch.setattr(bench, "SWEPT_OPS", two_each)
    rows = bench.sweep(torch.float16, 16, 24, 1, 2, bench.Timing(), workers=1)
    by_kernel: dict[str, list] = {}
    for r in rows:
        by_kernel.setdefault(re.match(r"(diff )?(fwd|bwd_dkv|bwd_dq) ", r.variant)[0].strip(), []).append(r)
    assert list(by_kernel) == [f"{op}{kernel}" for op in ("", "diff ") for kernel in ("fwd", "bwd_dkv", "bwd_dq")]
    for kernel, group in by_kernel.items():
        times_ms = [r.fwd_ms if kernel.endswith("fwd") else r.fwd_bwd_ms for r in group]
        finite = [t for t in times_ms if math.isfinite(t)]
        assert finite == sorted(finite) and sum(r.note.startswith("default") for r in group) == 1
    failed = [r for r in rows if r.note.removeprefix("default ")]
    assert [(r.variant.split()[:2], r.note) for r in failed] == [
        (["diff", "bwd_dq"], "RuntimeError: out of resources: shared memory")]
    assert math.isnan(failed[0].fwd_bwd_ms)
    assert all(math.isfinite(r.fwd_ms if r.variant.removeprefix("diff ").startswith("fwd") else r.fwd_bwd_ms)
               for r in rows if r is not failed[0])
    assert all(bench.is_sweep_row(r) for r in rows) and "diff bwd_dkv" in bench.format_sweep(rows)
    single = bench.sweep(torch.float16, 16, 24, 1, 2, bench.Timing(), workers=1, ops=["single"])  # --sweep-ops single
    assert [r.variant for r in single] and not any(r.variant.startswith("diff ") for r in single)
    assert {r.variant.split()[0] for r in single} == {"fwd", "bwd_dkv", "bwd_dq"}


@pytest.mark.parametrize("target", [0.0, 0.5, 0.9])
def test_beta_for_zero_fraction_reaches_the_target_and_zero_means_dense(target):
    """The skip_zero rows' beta gives the asked fraction of zero causal weights; 0 (parse_args accepts it)
    gives a dense map: no all-zero tile, what skipping costs where there is nothing to skip."""
    assert parse_args(["--zero-fractions", str(target)]).zero_fractions == [target]
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 1, 512, 64, generator=gen), dim=-1) for _ in range(2))
    beta = bench.beta_for_zero_fraction(q, k, target)
    weights_zero, tiles_zero = bench.zero_fractions(q, k, beta)
    if target == 0.0:
        assert beta == pytest.approx(-math.sqrt(64 / (2 * math.log(2)))) and weights_zero < 0.01 and tiles_zero == 0.0
    else:
        assert abs(weights_zero - target) < 0.02


def test_repeated_rounds_give_the_median_and_the_spread_of_each_row():
    """--repeats: each row's median over the rounds that timed it, (max - min) / median, the largest memory,
    a failed round's note; one round leaves the times as they are and the spread unmeasured."""
    point = dict(dtype="bfloat16", head_dim=64, seq_len=4096, batch=4, heads=16)
    rounds = [[Result("sdpa cudnn", **point, fwd_ms=f, fwd_bwd_ms=fb, fwd_mib=m, fwd_bwd_mib=2 * m),
               Result("threshold p=2", **point, fwd_ms=2 * f, fwd_bwd_ms=math.nan if i == 1 else 3 * fb, note=n)]
              for i, (f, fb, m, n) in enumerate([(1.0, 4.0, 30.0, "ok"), (1.2, 3.0, 32.0, "failed: OOM"),
                                                 (0.9, 5.0, math.nan, "ok")])]
    cudnn, ours = bench.combine_rounds(rounds)
    assert (cudnn.fwd_ms, cudnn.fwd_bwd_ms, cudnn.fwd_mib, cudnn.fwd_bwd_mib) == (1.0, 4.0, 32.0, 64.0)
    assert cudnn.fwd_spread == pytest.approx(0.3) and cudnn.fwd_bwd_spread == pytest.approx(0.5)
    assert ours.fwd_ms == 2.0 and ours.fwd_bwd_ms == 13.5 and ours.fwd_bwd_spread == pytest.approx(3 / 13.5)
    assert ours.note == "failed: OOM" and cudnn.note == ""
    table = format_table([cudnn, ours])
    assert table.splitlines()[0].count("spread") == 2 and " 30.0%" in table.splitlines()[1]
    (once,) = bench.combine_rounds([rounds[0][:1]])
    assert once.fwd_ms == 1.0 and math.isnan(once.fwd_spread) and math.isnan(once.fwd_bwd_spread)
    with pytest.raises(ValueError, match="same rows in the same order"):
        bench.combine_rounds([rounds[0], rounds[1][::-1]])


def test_median_spread_of_repeated_timings():
    """The median and (max - min) / median; NaN where undefined: no timing, or one (a spread needs two)."""
    assert bench.median_spread([2.0, 1.0, 4.0]) == (2.0, 1.5)
    median, spread = bench.median_spread([3.0])
    assert median == 3.0 and math.isnan(spread)
    assert all(math.isnan(x) for x in bench.median_spread([]))
