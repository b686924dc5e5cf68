"""Host time of eager calls with and without call plans (lit_thresh/ops/call_plans.py), two versions of the
package in one process. Tiny (1, 2, 128, 64) inputs (kernel time far below the host's), no synchronisation
in the loops, the cases interleaved: median [min - max] over 7 loops of 300 calls, in us (bench._host_us).
Calls that record a gradient take beta as an nn.Parameter, as a model's learned beta is. Each version's
outputs and gradients are checked against the first's (bit for bit) before timing.

Each version is a copy of the package renamed lit_thresh_<name> (the recipe of results/host_engine_thread.py),
e.g. main = the commit before call plans and plans = the working tree:

    mkdir -p .ab && git archive HEAD lit_thresh | tar -x -C .ab && mv .ab/lit_thresh .ab/lit_thresh_main
    cp -r lit_thresh .ab/lit_thresh_plans
    for name in main plans; do grep -rl --include=*.py lit_thresh .ab/lit_thresh_$name | xargs sed -i \\
        -e "s/\\blit_thresh\\./lit_thresh_$name./g" -e "s/from lit_thresh import/from lit_thresh_$name import/"; done
    PYTHONPATH=$PWD/.ab:$PYTHONPATH python results/host_call_plans.py main,plans
"""

import importlib
import statistics
import sys

import torch
import torch.nn.functional as F

from lit_thresh.bench import _host_us

N, ROUNDS = 300, 7


def cases(ops, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (0.5 * torch.randn(1, 2, 128, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    beta = torch.tensor([0.5, 0.75], device="cuda")
    beta_leaf = torch.nn.Parameter(beta.clone())  # a model's learned beta
    f = ops.threshold_attention
    return {
        "forward, no grad, (H,) beta": lambda: f(q, k, v, beta, 2.0),
        "forward, no grad, float beta": lambda: f(q, k, v, 0.5, 2.0),
        "forward with grad, (H,) beta (no backward)": lambda: f(*leaves, beta_leaf, 2.0),
        "forward + backward, (H,) beta": lambda: f(*leaves, beta_leaf, 2.0).backward(dout),
    }


def outputs(ops, dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs of 3 no-grad calls and of a forward+backward's gradients, called 3 times (checked, then planned)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (0.5 * torch.randn(2, 4, 200, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    beta = torch.linspace(0.25, 1.0, 4, device="cuda")
    got = [ops.threshold_attention(q, k, v, beta, 2.0) for _ in range(3)]
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        ops.threshold_attention(*leaves, 2.0).backward(dout)
        got += [t.grad for t in leaves]
    return got


def check_versions(versions: dict, outputs) -> None:
    """Print whether each version's outputs(ops, dtype) equal the first version's, bit for bit, in bf16 and fp16."""
    names = list(versions)
    for dtype in (torch.bfloat16, torch.float16):
        first = None
        for name, ops in versions.items():
            got = outputs(ops, dtype)
            first = first or got
            same = all(torch.equal(a, b) for a, b in zip(got, first))
            print(f"{dtype}: {name} outputs and gradients equal to {names[0]}'s: {same}")


def time_cases(timed: dict, title: str) -> None:
    """Host time per call of each case, interleaved in ROUNDS loops of N calls: median [min - max], us."""
    times: dict[str, list[float]] = {case: [] for case in timed}
    for _ in range(ROUNDS):
        for case, fn in timed.items():
            times[case].append(_host_us(fn, N))
    print(f"\nhost us per call, {title}, median [min - max] of {ROUNDS} loops of {N} calls")
    for case, ts in times.items():
        print(f"  {case:<58} {statistics.median(ts):8.1f} [{min(ts):.1f} - {max(ts):.1f}]")


def main(names: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    versions = {name: importlib.import_module(f"lit_thresh_{name}.ops") for name in names}
    check_versions(versions, outputs)
    qd, kd, vd = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    timed = {f"{name}: {case}": fn for name, ops in versions.items()
             for case, fn in cases(ops, torch.bfloat16).items()}
    leaves = [t.clone().requires_grad_() for t in (qd, kd, vd)]
    timed["sdpa: forward, no grad"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    timed["sdpa: forward with grad (no backward)"] = lambda: F.scaled_dot_product_attention(*leaves, is_causal=True)
    timed["sdpa: forward + backward"] = lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(qd)
    time_cases(timed, "bf16 (1, 2, 128, 64)")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["main", "plans"])
