"""Host time of eager calls of the fused differential op with and without its call plans
(call_plans.differential_signature), two versions of the package in one process (the recipe of
results/host_call_plans.py). Tiny (1, 2, 128, 32) bf16 q1, q2, k1, k2, v (kernel time far below the host's), no
synchronisation in the loops, the cases interleaved: median [min - max] over 7 loops of 300 calls, in us
(host_call_plans.time_cases). The training cases pass beta as an nn.Parameter and lambda as a 0-d tensor requiring grad, as
the diff_threshold variant does. Each version's outputs and gradients are checked against the first's (bit for
bit) before timing:

    PYTHONPATH=$PWD/.ab:$PYTHONPATH python results/host_differential.py main,new
"""

import importlib
import sys

import torch

from host_call_plans import check_versions, time_cases  # this folder is the script's first path entry


def cases(ops) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q1, q2, k1, k2, v, dout = (0.5 * torch.randn(1, 2, 128, 32, device="cuda", dtype=torch.bfloat16, generator=gen)
                               for _ in range(6))
    leaves = [t.clone().requires_grad_() for t in (q1, q2, k1, k2, v)]
    beta = torch.tensor([0.5, 0.75], device="cuda")
    lam = torch.tensor([0.3, 0.2], device="cuda")
    beta_leaf = torch.nn.Parameter(beta.clone())  # a model's learned beta
    lam_leaf = torch.tensor(0.3, device="cuda", requires_grad=True)  # the model's lambda: 0-d
    f = ops.differential_threshold_attention
    return {
        "forward, no grad, float beta and lambda": lambda: f(q1, q2, k1, k2, v, 0.5, 0.3, 2.0),
        "forward, no grad, (H,) beta and lambda": lambda: f(q1, q2, k1, k2, v, beta, lam, 2.0),
        "forward with grad (no backward)": lambda: f(*leaves, beta_leaf, lam_leaf, 2.0),
        "forward + backward": lambda: f(*leaves, beta_leaf, lam_leaf, 2.0).backward(dout),
    }


def outputs(ops, dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs of 3 no-grad calls, and every gradient of 3 forward+backward calls (checked, then planned)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q1, q2, k1, k2, v, dout = (0.5 * torch.randn(2, 4, 200, 64, device="cuda", dtype=dtype, generator=gen)
                               for _ in range(6))
    beta = torch.linspace(0.25, 1.0, 4, device="cuda")
    got = [ops.differential_threshold_attention(q1, q2, k1, k2, v, beta, 0.3, 2.0) for _ in range(3)]
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q1, q2, k1, k2, v, beta)]
        lam = torch.tensor(0.3, device="cuda", requires_grad=True)
        ops.differential_threshold_attention(*leaves, lam, 2.0).backward(dout)
        got += [t.grad for t in (*leaves, lam)]
    return got


def main(names: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    versions = {name: importlib.import_module(f"lit_thresh_{name}.ops") for name in names}
    check_versions(versions, outputs)
    timed = {f"{name}: {case}": fn for name, ops in versions.items() for case, fn in cases(ops).items()}
    time_cases(timed, "bf16 (1, 2, 128, 32)")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["main", "new"])
