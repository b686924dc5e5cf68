"""stacked_row_norms (row_norms_kernel): the fp32 row norms that bound the fp16 row scales and set the skip_zero
margin, against torch.linalg.vector_norm in float64, over odd head dims, strided views, every dtype and
non-finite rows."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lit_thresh.ops.triton_kernels import _finite_max
from lit_thresh.ops.triton_launch import _margin, stacked_row_norms
from tests.ops.helpers import generator, randn

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def want(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.double(), dim=-1)  # (B, H, T)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_of_odd_sizes_and_strided_views_stack_in_order(device, dtype):
    gen = generator("row_norms", dtype)
    a = randn(gen, 2, 70, 3, 72, dtype=dtype, device=device).transpose(1, 2)  # (B, H, T, D) with T, H swapped in memory
    b = randn(gen, 2, 3, 70, 2 * 200, dtype=dtype, device=device)[..., ::2]  # a column stride of 2, D = 200
    c = randn(gen, 2, 3, 70, 1, dtype=dtype, device=device, scale=3.0)  # D = 1
    got = stacked_row_norms(a, b, c)
    assert got.shape == (2, 3, 3, 70) and got.dtype == torch.float32 and got.is_contiguous()
    for i, x in enumerate((a, b, c)):
        err = (got[:, :, i].double() - want(x)).abs() / want(x)  # (B, H, T) one relative error per row
        assert err.max() < 1e-6, i  # fp32 sums of squares (fp64 inputs rounded to fp32 first)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_non_finite_and_zero_rows(device):
    x = randn(generator("row_norms special"), 1, 2, 5, 16, dtype=torch.float16, device=device)
    x[0, 0, 1, 3], x[0, 0, 2, 0], x[0, 1, 3] = float("inf"), float("nan"), 0.0
    x[0, 1, 4] = 60000.0  # squares overflow fp16, not the fp32 sum: 4 * 60000
    got = stacked_row_norms(x)[:, :, 0]
    assert got[0, 0, 1] == float("inf") and got[0, 0, 2].isnan() and got[0, 1, 3] == 0
    assert torch.allclose(got[0, 1, 4], torch.tensor(240000.0, device=device))
    ordinary = torch.ones_like(got, dtype=torch.bool)
    ordinary[0, 0, 1:3] = ordinary[0, 1, 3:5] = False
    assert ((got[ordinary].double() - want(x)[ordinary]).abs() / want(x)[ordinary]).max() < 1e-6


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_empty_sequences_give_empty_norms(device):
    x = torch.empty(2, 3, 0, 16, device=device, dtype=torch.bfloat16)
    assert stacked_row_norms(x, x).shape == (2, 3, 2, 0)


def test_margin_is_one_percent_of_the_largest_possible_score():
    gen = generator("margin")
    q, k = randn(gen, 1, 2, 9, 24), randn(gen, 1, 1, 11, 24)
    expected = 1e-2 * 0.5 * want(q).max() * want(k).max()
    assert torch.allclose(_margin(q, k, -0.5).double(), expected.reshape(1), rtol=1e-6)
    k[0, 0, 4, 0] = float("inf")
    assert _margin(q, k, 0.5).isnan().all()  # keeps every tile


@triton.jit
def _finite_max_kernel(NORMS, BOUNDS, OUT):
    i = tl.program_id(0)
    tl.store(OUT + i, _finite_max(NORMS, tl.load(BOUNDS + 2 * i), tl.load(BOUNDS + 2 * i + 1)))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_finite_max_scans_ranges_over_several_trips_leaving_out_inf_and_nan(device):
    """The kernels' scan of the norms (_finite_max, 256 a trip from lo) against torch over ranges of no norm,
    one, under a trip, exactly one trip and many with a short last one, holding an inf, a NaN (left out, also
    as a range's only or last norm) or the largest norm as their last."""
    norms = torch.rand(10_001, generator=generator("finite max"), dtype=torch.float64).float().to(device)  # (T,)
    norms[9000], norms[100], norms[5000] = float("inf"), float("nan"), 7.0
    ranges = [(0, 10_001), (1, 257), (255, 257), (101, 1024), (8999, 9001), (9001, 10_001), (5001, 10_001),
              (3, 4), (5000, 5001), (7, 7), (9000, 9001), (4745, 5001), (0, 101), (100, 101)]
    bounds = torch.tensor(ranges, dtype=torch.int32, device=device)
    got = torch.empty(len(ranges), device=device)
    _finite_max_kernel[(len(ranges),)](norms, bounds, got)
    for (lo, hi), value in zip(ranges, got.tolist()):
        part = norms[lo:hi]
        finite = part[torch.isfinite(part)]
        assert value == (finite.max().item() if finite.numel() else 0.0), (lo, hi)
