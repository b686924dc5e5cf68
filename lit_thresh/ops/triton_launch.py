"""Launchers of the Triton threshold attention kernels: block configs, grids, output allocation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from lit_thresh.ops.function import triton_interpreting
from lit_thresh.ops.triton_kernels import threshold_bwd_dkv_kernel, threshold_bwd_dq_kernel, threshold_fwd_kernel


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of one kernel."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    fwd: BlockConfig
    bwd_dkv: BlockConfig
    bwd_dq: BlockConfig


def default_configs(head_dim: int, dtype: torch.dtype) -> KernelConfigs:
    """Tiles per kernel. D <= 64 in fp16/bf16: the fastest of the H200 sweep (`python -m lit_thresh.bench
    --sweep`); larger head dims and fp32 are smaller-tile starting points, not yet tuned. Small tiles under
    the interpreter."""
    if triton_interpreting():
        return KernelConfigs(BlockConfig(32, 32), BlockConfig(32, 32), BlockConfig(32, 32))
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfigs(BlockConfig(64, 32, 4, 2), BlockConfig(32, 64, 4, 2), BlockConfig(64, 32, 4, 2))
    if head_dim > 64:
        return KernelConfigs(BlockConfig(128, 64, 8, 3), BlockConfig(64, 64, 8, 2), BlockConfig(64, 64, 8, 2))
    return KernelConfigs(BlockConfig(64, 64, 4, 3), BlockConfig(64, 64, 4, 3), BlockConfig(64, 64, 4, 3))


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


def _common_meta(q: torch.Tensor, d: int, dv: int, power: float) -> dict:
    return dict(
        D=d,
        DV=dv,
        BLOCK_D=_block_dim(d),
        BLOCK_DV=_block_dim(dv),
        POWER_MODE=_power_mode(power),
        FP16_RANGE=q.dtype == torch.float16,
        PRECISION=_precision(q.dtype),
        UPCAST=q.dtype == torch.bfloat16 and triton_interpreting(),
    )


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
    cfg = (configs or default_configs(d, q.dtype)).fwd
    out = _empty_like_layout(q, (b, hq, tq, dv))
    grid = (triton.cdiv(tq, cfg.block_m), b * hq)
    threshold_fwd_kernel[grid](
        q, k, v, out, beta,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        hq, hq // hkv, tq, tk, scale, power, 2.0 / d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_common_meta(q, d, dv, power),
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
    cfgs = configs or default_configs(d, q.dtype)
    meta = _common_meta(q, d, dv, power)
    scalars = (tq, tk, scale, power, 2.0 / d)
    dq, dk, dval = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    cfg = cfgs.bwd_dkv
    threshold_bwd_dkv_kernel[(triton.cdiv(tk, cfg.block_n), b * hkv)](
        q, k, v, dout, dk, dval, beta,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dval.stride(),
        hkv, hq // hkv, *scalars,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **meta,
    )

    cfg = cfgs.bwd_dq
    dbeta_rows = torch.empty(b * hq, tq, device=q.device, dtype=torch.float32) if need_dbeta else dq
    threshold_bwd_dq_kernel[(triton.cdiv(tq, cfg.block_m), b * hq)](
        q, k, v, dout, dq, dbeta_rows, beta,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        hq, hq // hkv, *scalars,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        BETA_GRAD=need_dbeta, **meta,
    )
    dbeta = dbeta_rows.view(b, hq, tq).sum(dim=(0, 2)).to(beta.dtype) if need_dbeta else None
    return dq, dk, dval, dbeta
