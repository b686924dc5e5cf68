"""Launchers of the Triton threshold attention kernels: block configs, grids, output allocation."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton

from lit_thresh.ops.backend import triton_interpreting
from lit_thresh.ops.triton_kernels import threshold_bwd_dkv_kernel, threshold_bwd_dq_kernel, threshold_fwd_kernel


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of one kernel. skip_zero: skip the products after the score product
    on tiles whose rectified scores are all exactly 0 (exact either way; on the H200 it cost 1.5-2x on
    dense maps and paid only for fp16 maps with ~96% all-zero tiles: lit_thresh/ops/PERF.md).
    tma: read the inputs through TMA tensor descriptors where their layout allows it (unit last stride,
    16-byte aligned base and strides, tile rows of at most 256 bytes), else through pointers."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    skip_zero: bool = False
    tma: bool = False


@dataclass(frozen=True)
class KernelConfigs:
    fwd: BlockConfig
    bwd_dkv: BlockConfig
    bwd_dq: BlockConfig


def default_configs(head_dim: int, dtype: torch.dtype) -> KernelConfigs:
    """Tiles per kernel for the larger of the q/k and v head dims (cached). fp16/bf16 up to D = 128: the
    fastest config per kernel of the H200 sweep (`python -m lit_thresh.bench --sweep`, T = 4096, B = 4,
    H = 16; ms below, `was` = the previous default; see lit_thresh/ops/PERF.md), with TMA loads where they
    won by >= 3% (each TMA launch costs host time for its descriptors); skip_zero off (on dense maps it
    doubled the forward's time). fp32 and D > 128: small-tile starting points, not tuned. Small tiles
    under the interpreter."""
    return _default_configs(head_dim, dtype, triton_interpreting())


@functools.lru_cache(maxsize=64)
def _default_configs(head_dim: int, dtype: torch.dtype, interpreting: bool) -> KernelConfigs:
    if interpreting:
        return KernelConfigs(BlockConfig(32, 32), BlockConfig(32, 32), BlockConfig(32, 32))
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfigs(BlockConfig(64, 32, 4, 2), BlockConfig(32, 64, 4, 2), BlockConfig(64, 32, 4, 2))
    small = BlockConfig(64, 64, 4, 3)
    if dtype == torch.bfloat16 and head_dim > 64:
        return KernelConfigs(
            BlockConfig(128, 64, 8, 3, tma=True),  # fwd 0.490 ms (was 0.529)
            BlockConfig(32, 64, 4, 3),  # backward 3.08 ms with the old dq (was 4.62)
            BlockConfig(128, 64, 8, 4, tma=True),  # backward 1.98 ms with the new dkv (128x64 w8 s3: 2.07)
        )
    if dtype == torch.bfloat16:  # fwd 0.285, dq 1.306 as before; backward 1.215 ms with this dkv (was 1.307)
        return KernelConfigs(small, BlockConfig(32, 128, 4, 3, tma=True), small)
    if head_dim > 64:  # float16
        return KernelConfigs(
            small,  # fwd 0.706 ms (was 0.908)
            BlockConfig(64, 128, 8, 3, tma=True),  # backward 4.53 ms with the old dq (was 5.60)
            BlockConfig(128, 64, 8, 3, tma=True),  # backward 4.23 ms with the old dkv (was 5.54)
        )
    return KernelConfigs(small, small, small)  # float16, D <= 64: fastest within 2% (fwd 0.493, backward 1.80)


def _dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    b, hq, tq, d = q.shape
    return b, hq, k.shape[1], tq, k.shape[2], d, v.shape[-1]


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _power_mode(power: float) -> int:
    return 1 if power == 1.0 else 2 if power == 2.0 else 0


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots follow torch.set_float32_matmul_precision: 'highest' -> ieee, else tf32."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _empty_like_layout(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Empty (B, H, T, D') tensor laid out as `like` is: (B, T, H, D') memory if like is a transposed view."""
    b, h, t, d = shape
    if like.stride(1) < like.stride(2):
        return like.new_empty(b, t, h, d).transpose(1, 2)
    return like.new_empty(b, h, t, d)


def _common_meta(q: torch.Tensor, d: int, dv: int, power: float) -> Mapping:
    """The constexprs every kernel takes (cached, read-only: host time per call matters for small inputs)."""
    return _meta(d, dv, power, q.dtype, _precision(q.dtype), triton_interpreting())


@functools.lru_cache(maxsize=256)
def _meta(d: int, dv: int, power: float, dtype: torch.dtype, precision: str, interpreting: bool) -> Mapping:
    return MappingProxyType(dict(
        D=d,
        DV=dv,
        BLOCK_D=_block_dim(d),
        BLOCK_DV=_block_dim(dv),
        POWER_MODE=_power_mode(power),
        FP16_RANGE=dtype == torch.float16,
        PRECISION=precision,
        UPCAST=dtype == torch.bfloat16 and interpreting,
    ))


def _tma_ready(*tensors: torch.Tensor, cols: int = 0) -> bool:
    """Whether every tensor meets the TMA layout rules (unit last stride, 16-byte aligned base and
    strides) and tile rows of `cols` elements span at most 256 bytes (the widest run on the H200)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]) or cols * size > 256:
            return False
    return True


def _sources(cfg: BlockConfig, tensors: tuple[torch.Tensor, ...], rows: tuple[int, ...], cols: tuple[int, ...]):
    """The (B, H, T, D) inputs as the kernel reads them: (B, H, T, D) TMA descriptors of blocks
    (1, 1, rows, cols) when cfg.tma and the layouts allow, else the tensors themselves; and USE_TMA."""
    if not (cfg.tma and _tma_ready(*tensors, cols=max(cols))):
        return tensors, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, c]) for t, r, c in zip(tensors, rows, cols))
    return descs, True


def _launch_meta(cfg: BlockConfig) -> dict:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SKIP_ZERO=cfg.skip_zero,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def triton_forward(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32
    power: float,
    scale: float,
    configs: KernelConfigs | None = None,
) -> torch.Tensor:
    """Forward pass; returns (B, Hq, Tq, Dv) in q's dtype."""
    b, hq, hkv, tq, tk, d, dv = _dims(q, k, v)
    cfg = (configs or default_configs(max(d, dv), q.dtype)).fwd
    out = _empty_like_layout(q, (b, hq, tq, dv))
    grid = (-(-tq // cfg.block_m), b * hq)  # ceil-divisions in plain ints: triton.cdiv costs host time
    meta = _common_meta(q, d, dv, power)
    bd, bdv = meta["BLOCK_D"], meta["BLOCK_DV"]
    srcs, use_tma = _sources(cfg, (q, k, v), (cfg.block_m, cfg.block_n, cfg.block_n), (bd, bd, bdv))
    threshold_fwd_kernel[grid](
        *srcs, out, beta,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        hq, hq // hkv, tq, tk, scale, power, 2.0 / d,
        USE_TMA=use_tma, **_launch_meta(cfg), **meta,
    )
    return out


def triton_backward(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32
    power: float,
    scale: float,
    dout: torch.Tensor,  # (B, Hq, Tq, Dv)
    need_dbeta: bool,
    configs: KernelConfigs | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward pass: (dq, dk, dv, dbeta); dbeta (Hq,) is reduced deterministically from per-row terms."""
    b, hq, hkv, tq, tk, d, dv = _dims(q, k, v)
    cfgs = configs or default_configs(max(d, dv), q.dtype)
    meta = _common_meta(q, d, dv, power)
    scalars = (tq, tk, scale, power, 2.0 / d)
    dq, dk, dval = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    bd, bdv = meta["BLOCK_D"], meta["BLOCK_DV"]

    cfg = cfgs.bwd_dkv
    m, n = cfg.block_m, cfg.block_n
    srcs, use_tma = _sources(cfg, (q, k, v, dout), (m, n, n, m), (bd, bd, bdv, bdv))
    threshold_bwd_dkv_kernel[(-(-tk // cfg.block_n), b * hkv)](
        *srcs, dk, dval, beta,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dval.stride(),
        hkv, hq // hkv, *scalars,
        USE_TMA=use_tma, **_launch_meta(cfg), **meta,
    )

    cfg = cfgs.bwd_dq
    dbeta_rows = torch.empty(b * hq, tq, device=q.device, dtype=torch.float32) if need_dbeta else dq
    m, n = cfg.block_m, cfg.block_n
    srcs, use_tma = _sources(cfg, (q, k, v, dout), (m, n, n, m), (bd, bd, bdv, bdv))
    threshold_bwd_dq_kernel[(-(-tq // cfg.block_m), b * hq)](
        *srcs, dq, dbeta_rows, beta,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        hq, hq // hkv, *scalars,
        BETA_GRAD=need_dbeta, USE_TMA=use_tma, **_launch_meta(cfg), **meta,
    )
    dbeta = dbeta_rows.view(b, hq, tq).sum(dim=(0, 2)).to(beta.dtype) if need_dbeta else None
    return dq, dk, dval, dbeta
