"""Test set-up: without CUDA, Triton kernels run on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are first imported (Triton reads it when it
decorates them), so it is set here, before any test module runs. Tests that need a GPU carry the
`gpu` marker and are deselected by default (`pytest -m gpu` runs them).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lit_thresh.ops.backend import triton_interpreting  # noqa: E402  (after TRITON_INTERPRET is set)

if triton_interpreting():  # tests/interpreter_patches.py: no repeated no-op work
    from tests.interpreter_patches import install

    install()

# `pytest -n N`: N workers share the cores, so each (and each command it starts) runs torch's CPU ops on one
# thread unless OMP_NUM_THREADS says otherwise; torch's default, a thread per core in every worker, oversubscribes
# them (on 2 cores, -n 2: 11% longer over test_configs, test_module and the single op's tests).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_call_plans(monkeypatch):
    """Each test starts without kept call plans (lit_thresh/ops/call_plans.py) and leaves none behind: a plan
    kept by one test would take another's calls past the launch path it means to test (TMA_MIN_WORK patched,
    stand-in kernels)."""
    from lit_thresh.ops import call_plans

    monkeypatch.setattr(call_plans, "_PLANS", {})
