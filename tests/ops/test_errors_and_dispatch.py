"""Bad arguments give clear errors naming the argument; each dispatch branch goes where it should."""

from __future__ import annotations

import textwrap

import pytest
import torch
import triton

from lit_thresh.ops import (
    api,
    differential_threshold_attention,
    differential_threshold_rela_triton,
    threshold_attention,
    threshold_rela_triton,
)
from lit_thresh.ops.backend import resolve_backend, triton_interpreting
from tests.ops.helpers import generator, randn
from tests.ops.sm90 import run_without_interpreter


def _qkv(hq=2, hkv=2, tq=8, tk=8, d=16, dv=16, b=1, dtype=torch.float32):
    gen = generator("errors", hq, hkv, tq, tk, d, dv, b)
    return (randn(gen, b, hq, tq, d, dtype=dtype), randn(gen, b, hkv, tk, d, dtype=dtype),
            randn(gen, b, hkv, tk, dv, dtype=dtype))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dims"),
        (lambda q, k, v: (q, k, v.unsqueeze(0)), ValueError, "v must have 4 dims"),
        (lambda q, k, v: (q, k.expand(2, -1, -1, -1), v), ValueError, "batch size"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "same head dim"),
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "same sequence length"),
        (lambda q, k, v: (q, k[:, :, :4], v[:, :, :4]), ValueError, r"q's sequence length \(8\) must be <= k's \(4\)"),
        (lambda q, k, v: (torch.cat([q, q[:, :1]], 1), k, v), ValueError, "multiple of k's and v's heads"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError, "k and v must have the same number of heads"),
        (lambda q, k, v: (q.half(), k, v), TypeError, "share one dtype"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "q must be float16, bfloat16, float32 or float64"),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, "on one device"),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q, None, v), TypeError, "k must be a torch.Tensor, got NoneType"),
        (lambda q, k, v: (q, k, 1.0), TypeError, "v must be a torch.Tensor, got float"),
    ],
)
def test_bad_tensors(make, error, match):
    with pytest.raises(error, match=match):
        threshold_attention(*make(*_qkv()))


def test_head_dim_over_256():
    q, k, v = _qkv(d=264, dv=16)
    with pytest.raises(ValueError, match=r"q/k head dim must be in \[1, 256\], got 264"):
        threshold_attention(q, k, v)
    q, k, v = _qkv(d=16, dv=300)
    with pytest.raises(ValueError, match=r"v head dim must be in \[1, 256\], got 300"):
        threshold_attention(q, k, v)


@pytest.mark.parametrize("power", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_power(power):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="power must be a finite float > 0"):
        threshold_attention(q, k, v, 1.0, power)
    with pytest.raises(ValueError, match="relu_power must be a finite float > 0"):
        threshold_rela_triton(q, k, v, 1.0, power)
    with pytest.raises(ValueError, match="relu_power must be a finite float > 0"):
        differential_threshold_rela_triton(q, q, k, k, v, 1.0, 0.5, relu_power=power)


def test_tensor_power_is_refused():
    """Reading a tensor power would sync with the device on every call: the ops take a float."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"power must be a float > 0 \(not a tensor\), got Tensor"):
        threshold_attention(q, k, v, 1.0, torch.tensor(2.0))
    with pytest.raises(TypeError, match=r"relu_power must be a float > 0 \(not a tensor\)"):
        threshold_rela_triton(q, k, v, 1.0, torch.tensor(2.0))


def test_per_head_beta_parameter_is_used_as_it_is(monkeypatch):
    """A model's (H,) float32 parameter reaches the op without a new tensor per call."""
    calls = []
    monkeypatch.setattr(api, "threshold_attention_apply", lambda *args: calls.append(args))
    q, k, v = _qkv()
    beta = torch.nn.Parameter(torch.tensor([0.5, -0.5]))
    threshold_attention(q, k, v, beta)
    assert calls[0][3] is beta


@pytest.mark.gpu
def test_no_host_sync_in_forward_and_backward():
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(tq=64, tk=64))
    beta = torch.nn.Parameter(torch.full((2,), 0.3, device="cuda"))
    threshold_attention(q, k, v, beta).sum().backward()  # compile the kernels first
    beta.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        threshold_attention(q, k, v, beta, 2.0).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert beta.grad is not None and torch.isfinite(beta.grad).all()


@pytest.mark.parametrize(
    "beta, error, match",
    [
        (torch.ones(3), ValueError, r"beta must be .* \(2,\) tensor"),
        (torch.ones(2, 1), ValueError, "beta must be"),
        (torch.ones(2, dtype=torch.long), TypeError, "floating-point"),
        ("1.0", TypeError, "beta must be a finite float or a tensor"),
        (float("nan"), TypeError, "beta must be a finite float"),
    ],
)
def test_bad_beta(beta, error, match):
    with pytest.raises(error, match=match):
        threshold_attention(*_qkv(), beta)


def test_bad_scale_backend_and_lambda():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="scale must be a finite float"):
        threshold_attention(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'torch'"):
        threshold_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match=r"lambda_param must be .* \(2,\) tensor"):
        differential_threshold_rela_triton(q, q, k, k, v, 1.0, torch.ones(5))


def test_dispatch_branches(monkeypatch):
    cpu32 = torch.empty(1, 1, 1, 16)
    assert resolve_backend("auto", cpu32.double()) == "torch"  # float64 always takes the PyTorch path
    assert resolve_backend("torch", cpu32) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu32) == "triton"  # CI: CPU tensors run the kernels in the interpreter
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        resolve_backend("triton", cpu32.double())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", cpu32) == "torch"  # plain CPU training: blockwise PyTorch
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", cpu32)


def test_more_batch_heads_than_the_kernels_grids_hold(monkeypatch):
    """Past MAX_BATCH_HEADS (B * Hq > 65535, CUDA's limit on the grid axis the kernels give to (batch, head)):
    'auto' runs blockwise PyTorch, and 'triton' is refused by name, for both ops."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = generator("grid_limit")
    q, k, v = (randn(gen, 4097, 16, 2, 4) for _ in range(3))  # (4097, 16, 2, 4): B * H = 65552
    assert resolve_backend("auto", q[:4095]) == "triton" and resolve_backend("auto", q) == "torch"
    out = threshold_attention(q, k, v, 0.3)
    assert torch.equal(out, threshold_attention(q, k, v, 0.3, backend="torch")) and out.abs().sum() > 0
    with pytest.raises(ValueError, match=r"at most 65535 \(batch, head\)s.*batch 4097 x 16 heads = 65552"):
        threshold_attention(q, k, v, 0.3, backend="triton")
    with pytest.raises(ValueError, match=r"at most 65535 \(batch, head\)s"):
        differential_threshold_attention(q, q, k, k, v, 0.3, 0.5, backend="triton")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", "0", "false", "off", "2", ""])
def test_interpreting_reads_triton_interpret_as_triton_does(monkeypatch, value):
    """The backend agrees with Triton on whether TRITON_INTERPRET is on: else CPU tensors would go to kernels
    Triton compiles for a GPU, or to the PyTorch path while Triton interprets."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreting() is bool(triton.knobs.runtime.interpret)


@pytest.mark.gpu
def test_dispatch_cuda():
    assert resolve_backend("auto", torch.empty(1, 1, 1, 16, device="cuda")) == "triton"


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter accepts code the compiler rejects (e.g. non-constexpr globals): compile every
    kernel for sm_90 down to a cubin in a process without TRITON_INTERPRET (no GPU needed), with skip_zero
    off and (bf16) on, the fp16 forward writing its map through row-scaled scores (p = 2), the skip_zero
    tile-map pre-pass, and the row norms' and the work lists' kernels; and the default tiles that load through
    TMA (bf16 D = 128, fp16 D = 64's forward) with their inputs as tensor descriptors. The bf16 case types the
    float scalars fp64, as torch.compile passes Python floats to user kernels."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import torch
        from lit_thresh.ops import triton_kernels as tk, triton_launch as tl
        from tests.ops.sm90 import compile_for_sm90, descriptor_blocks

        names = ("threshold_fwd_kernel", "threshold_bwd_dkv_kernel", "threshold_bwd_dq_kernel")
        shapes = {"fp16": (48, 0, "fp32"), "bf16": (64, 2, "fp64"), "fp32": (128, 1, "fp32")}
        cases = [(name, dtype, False, shapes[dtype]) for name in names for dtype in ("fp16", "bf16", "fp32")]
        cases += [(name, "bf16", True, shapes["bf16"]) for name in names]
        cases += [("threshold_fwd_kernel", "fp16", True, (64, 2, "fp32")),
                  ("threshold_live_tiles_kernel", "fp32", True, shapes["fp32"])]
        for name, dtype, skip, (d, power_mode, float_type) in cases:
            consts = dict(D=d, DV=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(d),
                          BLOCK_M=64, BLOCK_N=64, POWER_MODE=power_mode, ROW_SCALE=dtype == "fp16",
                          PRECISION="tf32" if dtype == "fp32" else "ieee", UPCAST=False, SKIP_ZERO=skip,
                          USE_TMA=False, FP16_RANGE=False, BETA_GRAD=True)
            compile_for_sm90(getattr(tk, name), consts, dtype, float_type)
        # the long maps' default tiles that load through TMA (bf16 D = 128, fp16 D = 64's forward), with descriptors
        cfgs = tl.default_configs(128, torch.bfloat16)
        tma_cases = [(name, "bf16", 128, cfg) for name, cfg in zip(names, (cfgs.fwd, cfgs.bwd_dkv, cfgs.bwd_dq))]
        tma_cases.append(("threshold_fwd_kernel", "fp16", 64, tl.default_configs(64, torch.float16).fwd))
        for name, dtype, d, cfg in tma_cases:
            assert cfg.tma, (name, dtype, d)
            descriptors = descriptor_blocks(getattr(tk, name), cfg.block_m, cfg.block_n, d, d)
            consts = dict(D=d, DV=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, POWER_MODE=2,
                          ROW_SCALE=dtype == "fp16", PRECISION="ieee", UPCAST=False, SKIP_ZERO=False, USE_TMA=True,
                          FP16_RANGE=False, BETA_GRAD=True)
            compile_for_sm90(getattr(tk, name), consts, dtype, "fp32", descriptors=descriptors,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        norms = tk.row_norms_kernel  # (X, OUT, ints...): the launcher's constexprs at D = 200 and 64
        for x_type, d, block_d, block_t in (("*bf16", 200, 256, 32), ("*fp16", 64, 64, 128)):
            sig = {arg: x_type if arg == "X" else "*fp32" if arg == "OUT" else "i32" for arg in norms.arg_names}
            sig.update(D="constexpr", BLOCK_D="constexpr", BLOCK_T="constexpr")
            triton.compile(ASTSource(fn=norms, signature=sig, constexprs=dict(D=d, BLOCK_D=block_d, BLOCK_T=block_t)),
                           target=GPUTarget("cuda", 90, 32))
        lists = tk.tile_lists_kernel  # (LIVE, LISTS, COUNTS, ints...): kernel rows coarser, columns finer than the map
        for by_key, block_l in ((True, 1024), (False, 64)):
            sig = {arg: "*i8" if arg == "LIVE" else "*i32" if arg in ("LISTS", "COUNTS") else "i32" for arg in lists.arg_names}
            consts = dict(ROW_TILE=64, ROW_GRAIN=32, COL_TILE=32, COL_GRAIN=64, BY_KEY=by_key, BLOCK_L=block_l)
            sig.update(dict.fromkeys(consts, "constexpr"))
            triton.compile(ASTSource(fn=lists, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        print("compiled")
        """
    )
    run_without_interpreter(script, tmp_path, timeout=600)
