"""Fused differential threshold attention in Triton: kernels (forward, backward dK/dV, backward dQ/dbeta/dlambda)
and their launchers.

Per (batch, query head h): x1_ij = scale q1_i.k1_j - tau_i, x2_ij = scale q2_i.k2_j - tau_i for key
j <= pos_i (else 0), P = ReLU(x1)^p - lambda_h ReLU(x2)^p, out = P V: one output, V read once, one beta.
Backward: dP = dO V^T, dS1 = dP p ReLU(x1)^(p-1), dS2 = -lambda dP p ReLU(x2)^(p-1), dV = P^T dO,
dK_m = scale dS_m^T Q_m, dQ_m = scale dS_m K_m, dbeta_h = -sum (dS1 + dS2) gain_i, dlambda_h = -sum dP ReLU(x2)^p.
dbeta and dlambda are reduced on the host from per-row partial sums (no atomics, deterministic).

Tiling, masking, accumulation and fp16 range handling are the single op's (lit_thresh.ops.triton_kernels),
whose jit helpers these kernels call. fp16 (ROW_SCALE) scales each row of P, dS1, dS2 (forward, dQ: query
rows; dK/dV: key rows of the transposed tiles) by one power of two fixed before the loop, from bounds on
both maps: x_m,ij <= base_m,i = |scale| |q_m,i| max_j |k_m,j| + max(-tau_i, 0), so |P_ij| <= base_1^p +
|lambda| base_2^p <= 2 max(base_1^p, |lambda| base_2^p), |dS1_ij| <= p |dO_i| |v_j| base_1^(p-1) and
|dS2_ij| <= |lambda| p |dO_i| |v_j| base_2^(p-1) (p >= 1; the dK/dV kernel takes the maxima over the query
rows and heads that see a key). The row norms of k1, k2 (forward), q1, q2, dO (dK/dV) and k1, k2, v (dQ)
come from the launchers. p < 1 keeps the per-tile scaling of dS1, dS2 (FP16_RANGE) in the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from lit_thresh.ops import triton_launch
from lit_thresh.ops.backend import triton_interpreting
from lit_thresh.ops.fast_launch import FastLaunch, launch
from lit_thresh.ops.triton_kernels import (
    _any_live,
    _as_fp32,
    _dot_rows,
    _finite_max,
    _fp16_exp,
    _gain,
    _head_src,
    _load_tile,
    _log2_grad_bound,
    _log2_weight_bound,
    _mma,
    _rectify,
    _rectify_slope,
    _row_norms,
    _seq_tile,
    _store_tile,
)
from lit_thresh.ops.triton_launch import (
    BlockConfig,
    KernelConfigs,
    _block_dim,
    _empty_like_layout,
    _on_current_cuda_device,
    _power_mode,
    _precision,
    _sources,
    gain_table,
    stacked_row_norms,
)


@triton.jit
def _diff_fwd_update(
    acc, x1, x2, lam, p_mul, start_n, v_src, b, hk, stride_vt, stride_vd, TK, power,
    DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, CHECK_ROWS: tl.constexpr,
    POWER_MODE: tl.constexpr, P_SCALED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """acc + (ReLU(x1)^p - lambda ReLU(x2)^p) V for one key tile (V is loaded only here, when needed);
    P_SCALED: P's rows are multiplied by p_mul (BLOCK_M,) before the cast."""
    v = _seq_tile(v_src, b, hk, start_n, stride_vt, stride_vd, TK, DV, BLOCK_N, BLOCK_DV, CHECK_ROWS, USE_TMA)  # (BLOCK_N, BLOCK_DV)
    p = _rectify(x1, power, POWER_MODE) - lam * _rectify(x2, power, POWER_MODE)  # (BLOCK_M, BLOCK_N)
    return _dot_rows(p, p_mul, v, acc, P_SCALED, False, PRECISION, UPCAST)


@triton.jit
def _key_tiles_and_scores(
    q1, q2, tau, pos, k1_src, k2_src, b, hk, start_n, stride_kt, stride_kd, TK, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """The key tiles k1, k2 (BLOCK_N, BLOCK_D) of keys [start_n, start_n + BLOCK_N) of kv head (b, hk) and the
    shifted scores x_m = scale q_m k_m^T - tau (BLOCK_M, BLOCK_N) of both maps, 0 on future keys where
    CAUSAL_MASK (the diagonal blocks); scale: a scalar or (BLOCK_M, 1) row scales."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if USE_TMA:
        k1 = _seq_tile(k1_src, b, hk, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, CAUSAL_MASK, True)  # (BLOCK_N, BLOCK_D)
        k2 = _seq_tile(k2_src, b, hk, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, CAUSAL_MASK, True)  # (BLOCK_N, BLOCK_D)
    else:  # one offset tile for both pointers (_seq_tile's would be built twice: 2 more instructions per tile)
        offs_d = tl.arange(0, BLOCK_D)
        k_offs = offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd
        k1 = _load_tile(k1_src + k_offs, offs_n, TK, offs_d, D, CAUSAL_MASK, D != BLOCK_D)  # (BLOCK_N, BLOCK_D)
        k2 = _load_tile(k2_src + k_offs, offs_n, TK, offs_d, D, CAUSAL_MASK, D != BLOCK_D)  # (BLOCK_N, BLOCK_D)
    x1 = _mma(q1, tl.trans(k1), None, PRECISION, UPCAST) * scale - tau[:, None]  # (BLOCK_M, BLOCK_N)
    x2 = _mma(q2, tl.trans(k2), None, PRECISION, UPCAST) * scale - tau[:, None]  # (BLOCK_M, BLOCK_N)
    if CAUSAL_MASK:
        visible = offs_n[None, :] <= pos[:, None]
        x1 = tl.where(visible, x1, 0.0)
        x2 = tl.where(visible, x2, 0.0)
    return k1, k2, x1, x2


@triton.jit
def _diff_fwd_inner(
    acc, q1, q2, tau, lam, p_mul, pos, k1_src, k2_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, P_SCALED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SKIP_ZERO: tl.constexpr, USE_TMA: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        k1, k2, x1, x2 = _key_tiles_and_scores(q1, q2, tau, pos, k1_src, k2_src, b, hk, start_n, stride_kt, stride_kd,
                                               TK, scale, D, BLOCK_D, BLOCK_N, CAUSAL_MASK, PRECISION, UPCAST, USE_TMA)
        if SKIP_ZERO:
            if _any_live(x1) | _any_live(x2):
                acc = _diff_fwd_update(acc, x1, x2, lam, p_mul, start_n, v_src, b, hk, stride_vt, stride_vd, TK, power,
                                       DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, POWER_MODE, P_SCALED, PRECISION, UPCAST,
                                       USE_TMA)
        else:
            acc = _diff_fwd_update(acc, x1, x2, lam, p_mul, start_n, v_src, b, hk, stride_vt, stride_vd, TK, power,
                                   DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, POWER_MODE, P_SCALED, PRECISION, UPCAST, USE_TMA)
    return acc


@triton.jit
def _log2_diff_weight_bound(base1, base2, log2_lam, power, POWER_MODE: tl.constexpr):
    """An upper bound of log2(base1^p + |lambda| base2^p) (the bound of |P|), as 1 + the log2 of the larger
    term (at most one bit loose); log2_lam = log2 |lambda| (-inf for lambda = 0: the first term alone)."""
    return 1.0 + tl.maximum(_log2_weight_bound(base1, power, POWER_MODE),
                            _log2_weight_bound(base2, power, POWER_MODE) + log2_lam)


@triton.jit
def diff_threshold_fwd_kernel(
    Q1, Q2, K1, K2, V, O, BETA, GAINS, LAM, ROW_NORMS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, GROUP, TQ, TK, scale, power,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SKIP_ZERO: tl.constexpr = False, USE_TMA: tl.constexpr = False,
):
    """One program: BLOCK_M queries of one (batch, head). Grid (cdiv(TQ, BLOCK_M), B * H).
    q1 and q2 share strides, as do k1 and k2 (the launcher makes them so). USE_TMA: Q1, Q2, K1, K2, V are
    (B, H, T, D) tensor descriptors (their strides then unused). ROW_SCALE (fp16): P rows
    scaled into fp16's range by a power of two per row, from the key norms ROW_NORMS (B * H / GROUP, 2, TK)
    fp32, |k1_j| then |k2_j| (unused otherwise). SKIP_ZERO: skip the PV product of key tiles where both
    rectified score tiles are all exactly 0."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    past = TK - TQ

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    q1 = _seq_tile(_head_src(Q1, b, h, stride_qb, stride_qh, USE_TMA), b, h, pid_m * BLOCK_M, stride_qt, stride_qd,
                   TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    q2 = _seq_tile(_head_src(Q2, b, h, stride_qb, stride_qh, USE_TMA), b, h, pid_m * BLOCK_M, stride_qt, stride_qd,
                   TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    pos = offs_m + past  # absolute positions (BLOCK_M,)
    tau = tl.load(BETA + h) * _gain(GAINS, pos)  # (BLOCK_M,)
    lam = tl.load(LAM + h)

    k1_src = _head_src(K1, b, hk, stride_kb, stride_kh, USE_TMA)
    k2_src = _head_src(K2, b, hk, stride_kb, stride_kh, USE_TMA)
    v_src = _head_src(V, b, hk, stride_vb, stride_vh, USE_TMA)
    first_row = past + pid_m * BLOCK_M
    n_full = (first_row + 1) // BLOCK_N * BLOCK_N  # keys [0, n_full) are visible to every row
    n_end = tl.minimum(first_row + BLOCK_M, TK)  # no row sees a key at or past n_end

    x_scale = scale
    p_mul = tau  # unused unless ROW_SCALE with POWER_MODE 0
    if ROW_SCALE:
        norms = ROW_NORMS + (b * (H // GROUP) + hk) * 2 * TK  # |k1_j| then |k2_j| of this kv head
        neg_tau = tl.maximum(-tau, 0.0)
        base1 = tl.abs(scale) * _row_norms(q1) * _finite_max(norms, 0, n_end) + neg_tau  # (BLOCK_M,) >= every x1 of the row
        base2 = tl.abs(scale) * _row_norms(q2) * _finite_max(norms + TK, 0, n_end) + neg_tau  # (BLOCK_M,)
        e = _fp16_exp(_log2_diff_weight_bound(base1, base2, tl.log2(tl.abs(lam)), power, POWER_MODE))  # (BLOCK_M,)
        if POWER_MODE == 0:
            p_mul = tl.exp2(-e)
        else:  # folded into both maps' scores, free: ReLU(x_m 2^(-e/p))^p = ReLU(x_m)^p 2^-e exactly (e even for p = 2)
            if POWER_MODE == 2:
                e = 2.0 * tl.ceil(0.5 * e)
            row_scale = tl.exp2(-e / POWER_MODE)  # (BLOCK_M,)
            x_scale = (scale * row_scale)[:, None]  # (BLOCK_M, 1)
            tau = tau * row_scale
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    acc = _diff_fwd_inner(acc, q1, q2, tau, lam, p_mul, pos, k1_src, k2_src, v_src, b, hk,
                          stride_kt, stride_kd, stride_vt, stride_vd, TK, x_scale, power, 0, n_full,
                          D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, POWER_MODE, ROW_SCALE and POWER_MODE == 0,
                          PRECISION, UPCAST, SKIP_ZERO, USE_TMA)
    acc = _diff_fwd_inner(acc, q1, q2, tau, lam, p_mul, pos, k1_src, k2_src, v_src, b, hk,
                          stride_kt, stride_kd, stride_vt, stride_vd, TK, x_scale, power, n_full, n_end,
                          D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, POWER_MODE, ROW_SCALE and POWER_MODE == 0,
                          PRECISION, UPCAST, SKIP_ZERO, USE_TMA)
    if ROW_SCALE:
        acc = acc * tl.exp2(e)[:, None]

    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :] * stride_od
    _store_tile(o_ptrs, acc.to(O.dtype.element_ty), offs_m, TQ, offs_dv, DV, DV != BLOCK_DV)


@triton.jit
def _diff_bwd_dkv_update(
    dk1, dk2, dv, x1_t, x2_t, lam, q1, q2, do, v, power, p_mul, ds1_mul, ds2_mul,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PART: tl.constexpr,
):
    """dK1, dK2, dV accumulators after one (key tile, query tile) pair with transposed scores (BLOCK_N, BLOCK_M);
    with ROW_SCALE, the rows of P^T, dS1^T and dS2^T are multiplied by p_mul, ds1_mul and ds2_mul (BLOCK_N,) first.
    PART: 0 updates all three, 1 dK1 and dV, 2 dK2 alone (x1_t and q1 are then not read); one map each: 3 dK1 and
    map 1's term of dV, P1^T dO (x2_t and q2 not read), 4 dK2 and map 2's, -lam P2^T dO (x1_t and q1 not read)."""
    if PART != 3:
        p2_t = _rectify(x2_t, power, POWER_MODE)
    dp_t = _mma(v, tl.trans(do), None, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_M)
    if PART != 2 and PART != 4:  # map 1
        p1_t = _rectify(x1_t, power, POWER_MODE)
        pv_t = p1_t if PART == 3 else p1_t - lam * p2_t
        dv = _dot_rows(pv_t, p_mul, do, dv, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_DV)
        ds1_t = dp_t * _rectify_slope(x1_t, p1_t, power, POWER_MODE)  # dS1^T / p
        dk1 = _dot_rows(ds1_t, ds1_mul, q1, dk1, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_D)
    if PART != 1 and PART != 3:  # map 2
        if PART == 4:
            dv = _dot_rows(-lam * p2_t, p_mul, do, dv, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_DV)
        ds2_t = -lam * dp_t * _rectify_slope(x2_t, p2_t, power, POWER_MODE)  # dS2^T / p
        dk2 = _dot_rows(ds2_t, ds2_mul, q2, dk2, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_D)
    return dk1, dk2, dv


@triton.jit
def _diff_bwd_dkv_inner(
    dk1, dk2, dv, k1, k2, v, offs_n, q1_src, q2_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
    beta, lam, past, TQ, scale, power, GAINS, p_mul, ds1_mul, ds2_mul, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SKIP_ZERO: tl.constexpr, PART: tl.constexpr, USE_TMA: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if PART != 3:
            q2 = _seq_tile(q2_src, b, h, start_m, stride_qt, stride_qd, TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
        do = _seq_tile(do_src, b, h, start_m, stride_dot, stride_dod, TQ, DV, BLOCK_M, BLOCK_DV, True, USE_TMA)  # (BLOCK_M, BLOCK_DV)
        pos = offs_m + past
        tau = beta * _gain(GAINS, pos)  # (BLOCK_M,)
        if CAUSAL_MASK:
            visible = offs_n[:, None] <= pos[None, :]
        if PART != 3:
            x2_t = _mma(k2, tl.trans(q2), None, PRECISION, UPCAST) * scale - tau[None, :]  # (BLOCK_N, BLOCK_M)
            if CAUSAL_MASK:
                x2_t = tl.where(visible, x2_t, 0.0)
        if PART != 2 and PART != 4:
            q1 = _seq_tile(q1_src, b, h, start_m, stride_qt, stride_qd, TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
            x1_t = _mma(k1, tl.trans(q1), None, PRECISION, UPCAST) * scale - tau[None, :]  # (BLOCK_N, BLOCK_M)
            if CAUSAL_MASK:
                x1_t = tl.where(visible, x1_t, 0.0)
        else:  # map 1 is not read
            q1 = q2
            x1_t = x2_t
        if PART == 3:  # map 2 is not read
            q2 = q1
            x2_t = x1_t
        if SKIP_ZERO:
            if _any_live(x1_t) | _any_live(x2_t):  # the one map twice in parts 2, 3 and 4
                dk1, dk2, dv = _diff_bwd_dkv_update(dk1, dk2, dv, x1_t, x2_t, lam, q1, q2, do, v, power,
                                                    p_mul, ds1_mul, ds2_mul,
                                                    POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, PART)
        else:
            dk1, dk2, dv = _diff_bwd_dkv_update(dk1, dk2, dv, x1_t, x2_t, lam, q1, q2, do, v, power,
                                                p_mul, ds1_mul, ds2_mul,
                                                POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, PART)
    return dk1, dk2, dv


@triton.jit
def diff_threshold_bwd_dkv_kernel(
    Q1, Q2, K1, K2, V, dO, dK1, dK2, dV, BETA, GAINS, LAM, ROW_NORMS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    HKV, GROUP, TQ, TK, scale, power,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, SKIP_ZERO: tl.constexpr = False, PART: tl.constexpr = 0, USE_TMA: tl.constexpr = False,
):
    """One program: dK1, dK2, dV of BLOCK_N keys of one (batch, kv head), summed over the GROUP query heads
    that share them (no atomics); with PART 1 dK1 and dV only, with PART 2 dK2 only (bwd_dk2 in the configs); with
    PART 3 dK1 and map 1's term of dV, with PART 4 dK2 and map 2's term of dV, added to the dV that PART 3 stored
    (bwd_dk2 with split_maps: each launch reads one map, as a single op's does).
    Grid (cdiv(TK, BLOCK_N), B * HKV). USE_TMA: Q1, Q2, K1, K2, V, dO are tensor descriptors. ROW_SCALE (fp16,
    p >= 1): the rows of P^T, dS1^T and dS2^T scaled into fp16's range by a power of two per key each, from the
    norms ROW_NORMS (B * HKV * GROUP, 3, TQ) fp32, |q1_i|, |q2_i| then |dO_i| (unused otherwise); FP16_RANGE
    (fp16, p < 1): per-tile scaling instead. SKIP_ZERO: skip the work after the score products of query tiles
    where both rectified score tiles are all exactly 0."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    past = TK - TQ

    first_key = pid_n * BLOCK_N
    offs_n = first_key + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k1 = _seq_tile(_head_src(K1, b, hk, stride_kb, stride_kh, USE_TMA), b, hk, first_key, stride_kt, stride_kd, TK, D,
                   BLOCK_N, BLOCK_D, True, USE_TMA)  # (BLOCK_N, BLOCK_D)
    k2 = _seq_tile(_head_src(K2, b, hk, stride_kb, stride_kh, USE_TMA), b, hk, first_key, stride_kt, stride_kd, TK, D,
                   BLOCK_N, BLOCK_D, True, USE_TMA)  # (BLOCK_N, BLOCK_D)
    v = _seq_tile(_head_src(V, b, hk, stride_vb, stride_vh, USE_TMA), b, hk, first_key, stride_vt, stride_vd, TK, DV,
                  BLOCK_N, BLOCK_DV, True, USE_TMA)  # (BLOCK_N, BLOCK_DV)

    # query rows m see the block when pos_m >= first_key, all of it when pos_m >= first_key + BLOCK_N - 1
    m_lo = tl.maximum(first_key - past, 0) // BLOCK_M * BLOCK_M
    m_full = tl.minimum(tl.cdiv(tl.maximum(first_key + BLOCK_N - 1 - past, 0), BLOCK_M) * BLOCK_M, TQ)

    p_mul = scale  # unused unless ROW_SCALE
    ds1_mul = scale
    ds2_mul = scale
    if ROW_SCALE:  # bounds over the rows of every query head of the group that see these keys
        q1_max = tl.zeros((), dtype=tl.float32)
        q2_max = tl.zeros((), dtype=tl.float32)
        do_max = tl.zeros((), dtype=tl.float32)
        neg_beta = tl.zeros((), dtype=tl.float32)
        lam_max = tl.zeros((), dtype=tl.float32)
        m_first = tl.maximum(first_key - past, 0)  # the first query row that sees these keys
        for g in range(GROUP):
            h = hk * GROUP + g
            norms = ROW_NORMS + (b * HKV * GROUP + h) * 3 * TQ  # |q1_i|, |q2_i| then |dO_i| of head h
            q1_max = tl.maximum(q1_max, _finite_max(norms, m_first, TQ))
            q2_max = tl.maximum(q2_max, _finite_max(norms + TQ, m_first, TQ))
            do_max = tl.maximum(do_max, _finite_max(norms + 2 * TQ, m_first, TQ))
            neg_beta = tl.maximum(neg_beta, -tl.load(BETA + h))
            lam_max = tl.maximum(lam_max, tl.abs(tl.load(LAM + h)))
        # (1,): -tau is largest at the last position a query tile reaches, padding rows past TQ included
        neg_tau = neg_beta * _gain(GAINS, tl.full((1,), TK - 1 + BLOCK_M, tl.int32))
        base1 = tl.abs(scale) * q1_max * _row_norms(k1) + neg_tau  # (BLOCK_N,) >= every x1 of the key
        base2 = tl.abs(scale) * q2_max * _row_norms(k2) + neg_tau  # (BLOCK_N,) >= every x2 of the key
        log2_lam = tl.log2(lam_max)
        log2_dp = tl.log2(do_max) + tl.log2(_row_norms(v))  # (BLOCK_N,) >= log2 |dP_ij|
        p_exp = _fp16_exp(_log2_diff_weight_bound(base1, base2, log2_lam, power, POWER_MODE))  # (BLOCK_N,)
        ds1_exp = _fp16_exp(_log2_grad_bound(base1, log2_dp, power, POWER_MODE))  # (BLOCK_N,)
        ds2_exp = _fp16_exp(log2_lam + _log2_grad_bound(base2, log2_dp, power, POWER_MODE))  # (BLOCK_N,)
        p_mul = tl.exp2(-p_exp)
        ds1_mul = tl.exp2(-ds1_exp)
        ds2_mul = tl.exp2(-ds2_exp)
    dk1 = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dk2 = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        beta = tl.load(BETA + h)
        lam = tl.load(LAM + h)
        q1_src = _head_src(Q1, b, h, stride_qb, stride_qh, USE_TMA)
        q2_src = _head_src(Q2, b, h, stride_qb, stride_qh, USE_TMA)
        do_src = _head_src(dO, b, h, stride_dob, stride_doh, USE_TMA)
        dk1, dk2, dv = _diff_bwd_dkv_inner(
            dk1, dk2, dv, k1, k2, v, offs_n, q1_src, q2_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
            beta, lam, past, TQ, scale, power, GAINS, p_mul, ds1_mul, ds2_mul, m_lo, m_full,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, True, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, SKIP_ZERO,
            PART, USE_TMA)
        dk1, dk2, dv = _diff_bwd_dkv_inner(
            dk1, dk2, dv, k1, k2, v, offs_n, q1_src, q2_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
            beta, lam, past, TQ, scale, power, GAINS, p_mul, ds1_mul, ds2_mul, m_full, TQ,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, False, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, SKIP_ZERO,
            PART, USE_TMA)
    if ROW_SCALE:
        dk1 = dk1 * tl.exp2(ds1_exp)[:, None]
        dk2 = dk2 * tl.exp2(ds2_exp)[:, None]
        dv = dv * tl.exp2(p_exp)[:, None]

    dk_offs = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    dv_ptrs = dV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :] * stride_dvd
    if PART != 2 and PART != 4:
        _store_tile(dK1 + dk_offs, (dk1 * (scale * power)).to(dK1.dtype.element_ty), offs_n, TK, offs_d, D, D != BLOCK_D)
    if PART == 4:  # map 1's term, stored by PART 3
        dv += _load_tile(dv_ptrs, offs_n, TK, offs_dv, DV, True, DV != BLOCK_DV).to(tl.float32)
    if PART != 2:
        _store_tile(dv_ptrs, dv.to(dV.dtype.element_ty), offs_n, TK, offs_dv, DV, DV != BLOCK_DV)
    if PART != 1 and PART != 3:
        _store_tile(dK2 + dk_offs, (dk2 * (scale * power)).to(dK2.dtype.element_ty), offs_n, TK, offs_d, D, D != BLOCK_D)


@triton.jit
def _diff_bwd_dq_update(
    dq1, dq2, ds_sum, dlam_sum, x1, x2, lam, do, k1, k2, ds1_mul, ds2_mul, start_n, v_src, b, hk, stride_vt,
    stride_vd, TK, power,
    DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, CHECK_ROWS: tl.constexpr,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, LAM_GRAD: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dQ1, dQ2 accumulators and per-row dbeta / dlambda sums after one (query tile, key tile) pair
    with scores x1, x2 (BLOCK_M, BLOCK_N); V is loaded only here, when needed. With ROW_SCALE, the rows
    of dS1 and dS2 are multiplied by ds1_mul and ds2_mul (BLOCK_M,) before the cast (not in the sums)."""
    v = _seq_tile(v_src, b, hk, start_n, stride_vt, stride_vd, TK, DV, BLOCK_N, BLOCK_DV, CHECK_ROWS, USE_TMA)  # (BLOCK_N, BLOCK_DV)
    dp = _mma(do, tl.trans(v), None, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_N)
    p2 = _rectify(x2, power, POWER_MODE)
    ds1 = dp * _rectify_slope(x1, _rectify(x1, power, POWER_MODE), power, POWER_MODE)  # dS1 / p
    ds2 = -lam * dp * _rectify_slope(x2, p2, power, POWER_MODE)  # dS2 / p
    dq1 = _dot_rows(ds1, ds1_mul, k1, dq1, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_D)
    dq2 = _dot_rows(ds2, ds2_mul, k2, dq2, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_D)
    if BETA_GRAD:
        ds_sum += tl.sum(ds1 + ds2, axis=1)
    if LAM_GRAD:
        dlam_sum += tl.sum(dp * p2, axis=1)
    return dq1, dq2, ds_sum, dlam_sum


@triton.jit
def _diff_bwd_dq_inner(
    dq1, dq2, ds_sum, dlam_sum, q1, q2, do, tau, lam, ds1_mul, ds2_mul, pos, k1_src, k2_src, v_src, b, hk,
    stride_kt, stride_kd, stride_vt, stride_vd, TK, scale, power, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, LAM_GRAD: tl.constexpr,
    SKIP_ZERO: tl.constexpr, USE_TMA: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        k1, k2, x1, x2 = _key_tiles_and_scores(q1, q2, tau, pos, k1_src, k2_src, b, hk, start_n, stride_kt, stride_kd,
                                               TK, scale, D, BLOCK_D, BLOCK_N, CAUSAL_MASK, PRECISION, UPCAST, USE_TMA)
        if SKIP_ZERO:
            if _any_live(x1) | _any_live(x2):
                dq1, dq2, ds_sum, dlam_sum = _diff_bwd_dq_update(
                    dq1, dq2, ds_sum, dlam_sum, x1, x2, lam, do, k1, k2, ds1_mul, ds2_mul, start_n, v_src, b, hk,
                    stride_vt, stride_vd, TK, power, DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, POWER_MODE, ROW_SCALE,
                    FP16_RANGE, PRECISION, UPCAST, BETA_GRAD, LAM_GRAD, USE_TMA)
        else:
            dq1, dq2, ds_sum, dlam_sum = _diff_bwd_dq_update(
                dq1, dq2, ds_sum, dlam_sum, x1, x2, lam, do, k1, k2, ds1_mul, ds2_mul, start_n, v_src, b, hk,
                stride_vt, stride_vd, TK, power, DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, POWER_MODE, ROW_SCALE,
                FP16_RANGE, PRECISION, UPCAST, BETA_GRAD, LAM_GRAD, USE_TMA)
    return dq1, dq2, ds_sum, dlam_sum


@triton.jit
def diff_threshold_bwd_dq_kernel(
    Q1, Q2, K1, K2, V, dO, dQ1, dQ2, DBETA_ROWS, DLAM_ROWS, BETA, GAINS, LAM, ROW_NORMS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, GROUP, TQ, TK, scale, power,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, LAM_GRAD: tl.constexpr, SKIP_ZERO: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,
):
    """One program: dQ1, dQ2 of BLOCK_M queries of one (batch, head), and their per-row terms
    -gain_i sum_j (dS1 + dS2)_ij into DBETA_ROWS and -sum_j dP_ij ReLU(x2_ij)^p into DLAM_ROWS
    (both (B * H, TQ) fp32, summed on the host; from unscaled dS1, dS2, dP). Grid (cdiv(TQ, BLOCK_M), B * H).
    USE_TMA: Q1, Q2, K1, K2, V, dO are tensor descriptors.
    ROW_SCALE (fp16, p >= 1): dS1 and dS2 rows scaled into fp16's range by a power of two per row each,
    from the norms ROW_NORMS (B * H / GROUP, 3, TK) fp32, |k1_j|, |k2_j| then |v_j| (unused otherwise);
    FP16_RANGE (fp16, p < 1): per-tile scaling instead."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    past = TK - TQ

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    start_m = pid_m * BLOCK_M
    q1 = _seq_tile(_head_src(Q1, b, h, stride_qb, stride_qh, USE_TMA), b, h, start_m, stride_qt, stride_qd, TQ, D,
                   BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    q2 = _seq_tile(_head_src(Q2, b, h, stride_qb, stride_qh, USE_TMA), b, h, start_m, stride_qt, stride_qd, TQ, D,
                   BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    do = _seq_tile(_head_src(dO, b, h, stride_dob, stride_doh, USE_TMA), b, h, start_m, stride_dot, stride_dod, TQ,
                   DV, BLOCK_M, BLOCK_DV, True, USE_TMA)  # (BLOCK_M, BLOCK_DV)
    pos = offs_m + past
    gain = _gain(GAINS, pos)
    tau = tl.load(BETA + h) * gain  # (BLOCK_M,)
    lam = tl.load(LAM + h)

    k1_src = _head_src(K1, b, hk, stride_kb, stride_kh, USE_TMA)
    k2_src = _head_src(K2, b, hk, stride_kb, stride_kh, USE_TMA)
    v_src = _head_src(V, b, hk, stride_vb, stride_vh, USE_TMA)
    first_row = past + start_m
    n_full = (first_row + 1) // BLOCK_N * BLOCK_N
    n_end = tl.minimum(first_row + BLOCK_M, TK)

    ds1_mul = tau  # unused unless ROW_SCALE
    ds2_mul = tau
    if ROW_SCALE:
        norms = ROW_NORMS + (b * (H // GROUP) + hk) * 3 * TK  # |k1_j|, |k2_j| then |v_j| of this kv head
        neg_tau = tl.maximum(-tau, 0.0)
        base1 = tl.abs(scale) * _row_norms(q1) * _finite_max(norms, 0, n_end) + neg_tau  # (BLOCK_M,) >= every x1 of the row
        base2 = tl.abs(scale) * _row_norms(q2) * _finite_max(norms + TK, 0, n_end) + neg_tau  # (BLOCK_M,)
        log2_dp = tl.log2(_row_norms(do)) + tl.log2(_finite_max(norms + 2 * TK, 0, n_end))  # (BLOCK_M,) >= log2 |dP_ij|
        ds1_exp = _fp16_exp(_log2_grad_bound(base1, log2_dp, power, POWER_MODE))  # (BLOCK_M,)
        ds2_exp = _fp16_exp(tl.log2(tl.abs(lam)) + _log2_grad_bound(base2, log2_dp, power, POWER_MODE))  # (BLOCK_M,)
        ds1_mul = tl.exp2(-ds1_exp)
        ds2_mul = tl.exp2(-ds2_exp)
    dq1 = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dq2 = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    ds_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dlam_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dq1, dq2, ds_sum, dlam_sum = _diff_bwd_dq_inner(
        dq1, dq2, ds_sum, dlam_sum, q1, q2, do, tau, lam, ds1_mul, ds2_mul, pos, k1_src, k2_src, v_src, b, hk,
        stride_kt, stride_kd, stride_vt, stride_vd, TK, scale, power, 0, n_full,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST,
        BETA_GRAD, LAM_GRAD, SKIP_ZERO, USE_TMA)
    dq1, dq2, ds_sum, dlam_sum = _diff_bwd_dq_inner(
        dq1, dq2, ds_sum, dlam_sum, q1, q2, do, tau, lam, ds1_mul, ds2_mul, pos, k1_src, k2_src, v_src, b, hk,
        stride_kt, stride_kd, stride_vt, stride_vd, TK, scale, power, n_full, n_end,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST,
        BETA_GRAD, LAM_GRAD, SKIP_ZERO, USE_TMA)
    if ROW_SCALE:
        dq1 = dq1 * tl.exp2(ds1_exp)[:, None]
        dq2 = dq2 * tl.exp2(ds2_exp)[:, None]

    dq_offs = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    _store_tile(dQ1 + dq_offs, (dq1 * (scale * power)).to(dQ1.dtype.element_ty), offs_m, TQ, offs_d, D, D != BLOCK_D)
    _store_tile(dQ2 + dq_offs, (dq2 * (scale * power)).to(dQ2.dtype.element_ty), offs_m, TQ, offs_d, D, D != BLOCK_D)
    row = pid_bh.to(tl.int64) * TQ + offs_m
    if BETA_GRAD:
        tl.store(DBETA_ROWS + row, -(gain * power) * ds_sum, mask=offs_m < TQ)
    if LAM_GRAD:
        tl.store(DLAM_ROWS + row, -dlam_sum, mask=offs_m < TQ)


_FWD, _BWD_DKV, _BWD_DQ = map(FastLaunch, (diff_threshold_fwd_kernel, diff_threshold_bwd_dkv_kernel,
                                             diff_threshold_bwd_dq_kernel))


def default_diff_configs(head_dim: int, dtype: torch.dtype, large: bool = True) -> KernelConfigs:
    """Tiles per kernel for the larger of the q/k and v head dims (cached). fp16/bf16 up to D = 128: the
    fastest config per kernel of an H200 sweep at T = 4096 (recorded in
    lit_thresh/ops/PERF.md, v3; each kernel timed with the others at the previous default; the combination,
    timed afterwards, is 1.03-1.32x faster than two single calls forward+backward, but 0.63-0.81x at fp16
    D = 128, whose backward then kept the per-tile fp16 rescaling); fp16 re-swept with the row scales
    (PERF.md v7: three kernels changed); for large calls (large_call), tiles with TMA loads where an H100 sweep
    at T = 4096 and 16384 found them >= 3% faster (PERF.md v25; at T = 1024 they took 1-4% longer), and at
    D = 128 dK/dV in two launches that read one map each (split_maps, PERF.md v26). fp32 and
    D > 128: small-tile starting points, not tuned. Small tiles under the interpreter."""
    return _default_diff_configs(head_dim, dtype, triton_interpreting(), large)


def large_call(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call gets default_diff_configs' large-call tiles: its work (triton_launch.call_work) at least twice
    the single op's triton_launch.TMA_MIN_WORK (two maps); at H = 16 and B * T = 16384, D = 64 from T = 4096 and
    D = 128 from T = 2048."""
    return triton_launch.call_work(q1, k1, v) >= 2 * triton_launch.TMA_MIN_WORK


@functools.lru_cache(maxsize=64)
def _default_diff_configs(head_dim: int, dtype: torch.dtype, interpreting: bool, large: bool) -> KernelConfigs:
    if interpreting:
        return KernelConfigs(BlockConfig(32, 32), BlockConfig(32, 32), BlockConfig(32, 32))
    if dtype == torch.float32 and head_dim > 64:
        return KernelConfigs(BlockConfig(32, 32, 4, 2), BlockConfig(16, 32, 4, 1), BlockConfig(32, 16, 4, 1))
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfigs(BlockConfig(64, 32, 4, 2), BlockConfig(32, 64, 4, 2), BlockConfig(64, 32, 4, 2))
    fp16 = dtype == torch.float16
    fp16_large = fp16 and large
    if head_dim > 64:  # the H200 sweep at T = 4096 (ms of the forward / of the whole backward, each kernel
        # timed with the others at the previous default; lit_thresh/ops/PERF.md, v3); large calls from v25's H100
        # sweep (ms of the whole backward at T = 4096 / 16384, the other tile's in brackets)
        if large:  # dK/dV in two launches that read one map each (PERF.md v26, one H100: the whole backward
            # bf16 3.35 / 11.77 ms against 3.87 / 13.77, fp16 4.12 / 13.10 against 4.64 / 15.79; 64x64 w8 s3 1.25-1.33x)
            split = BlockConfig(64, 128, 8, 3, tma=True)
            dkv = {"bwd_dkv": split, "bwd_dk2": split, "split_maps": True}
        else:  # dK2 in a second launch (PERF.md v20, one H100): bf16 forward+backward 0.963-0.969x the time of
            # one dK/dV launch; fp16 0.986-0.989x, under the 3% rule, so one launch
            dkv = {"bwd_dkv": BlockConfig(32, 64, 4, 2),  # bf16 4.41; fp16 5.45 in v7's sweep (64x64 w8 s2: 6.26)
                   "bwd_dk2": None if fp16 else BlockConfig(64, 128, 8, 2)}
        return KernelConfigs(
            fwd=BlockConfig(128, 64, 8, 3),  # bf16 0.883, fp16 1.110 (64x64 w8 s3: 1.711, 2.043)
            bwd_dq=BlockConfig(128, 64, 8, 2, tma=True) if fp16_large  # 4.679 / 15.934 (64x32 w4 s2: 4.809 / 17.359)
            else BlockConfig(64, 32, 4, 2) if fp16 else BlockConfig(128, 32, 8, 3),  # fp16 8.71, bf16 6.01
            **dkv,
        )
    # v3 and v7 (ms at T = 4096); large calls from v25 (ms at T = 4096 / 16384, the other tile's in brackets;
    # the forward's alone, the whole backward's)
    return KernelConfigs(
        BlockConfig(128, 64, 4, 3, tma=True) if fp16_large  # 0.532 / 1.804 (64x32 w4 s3: 0.555 / 1.958)
        else BlockConfig(64, 32, 4, 3) if fp16 else BlockConfig(128, 64, 8, 3),  # bf16 0.484; fp16 0.668 in v7
        BlockConfig(64, 64, 4, 3, tma=True) if large  # fp16 1.965 / 6.912 (2.016 / 7.537); bf16 1.783 / 6.404
        else BlockConfig(64, 64, 4, 3) if fp16 else BlockConfig(32, 64, 4, 3),  # (32x64 w4 s3: 1.840 / 6.749)
        BlockConfig(64, 64, 4, 3, tma=True) if large  # fp16 1.954 / 7.032 (1.997 / 7.291); bf16 1.771 / 6.060
        else BlockConfig(64, 64, 4, 3) if fp16 else BlockConfig(64, 32, 4, 3),  # (64x32 w4 s3: 1.822 / 6.663)
    )


def _strides_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (one shape) are read by the same strides: dims of size 1 are never stepped over."""
    return a.stride() == b.stride() or all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def match_strides(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b (one shape) with one set of strides, which the kernels take per q or k pair: as they are when
    they have one; else b copied into a's layout when a is dense, or a into b's when b is; else both contiguous."""
    if _strides_match(a, b):
        return a, b
    like_a = torch.empty_like(a)  # a's own strides when a is dense (no gaps, no overlaps), else contiguous
    if like_a.stride() == a.stride():
        return a, like_a.copy_(b)
    like_b = torch.empty_like(b)
    if like_b.stride() == b.stride():
        return like_b.copy_(a), b
    return a.contiguous(), b.contiguous()


def _kernel_meta(cfg: BlockConfig, q: torch.Tensor, d: int, dv: int, power: float, forward: bool, **flags: bool) -> Mapping:
    """Every constexpr and launch option of one kernel launch (cached, read-only: host time per call matters)."""
    return _meta(cfg, d, dv, power, q.dtype, _precision(q.dtype), triton_interpreting(), forward, tuple(flags.items()))


@functools.lru_cache(maxsize=256)
def _meta(cfg: BlockConfig, d: int, dv: int, power: float, dtype: torch.dtype, precision: str, interpreting: bool,
          forward: bool, flags: tuple[tuple[str, bool], ...]) -> Mapping:
    """fp16 scales P (forward) and P, dS1, dS2 (backward) rows by fixed powers of two (ROW_SCALE), except dS
    for p < 1, which has no bound: the backward then scales per tile (FP16_RANGE), as the single op does."""
    fp16 = dtype == torch.float16
    fp16_flags = dict(ROW_SCALE=fp16) if forward else dict(ROW_SCALE=fp16 and power >= 1.0, FP16_RANGE=fp16 and power < 1.0)
    return MappingProxyType(dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SKIP_ZERO=cfg.skip_zero,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        D=d,
        DV=dv,
        BLOCK_D=_block_dim(d),
        BLOCK_DV=_block_dim(dv),
        POWER_MODE=_power_mode(power),
        PRECISION=precision,
        UPCAST=dtype == torch.bfloat16 and interpreting,
        **fp16_flags,
        **dict(flags),
    ))


def _forward_launch(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, v: torch.Tensor,
                    beta: torch.Tensor, lam: torch.Tensor, power: float, scale: float,
                    configs: KernelConfigs | None) -> tuple:
    """What diff_triton_forward launches, (grid, tensors, scalars, constexprs), and its output, for q and k
    pairs whose strides match. With cfg.tma and layouts that allow it, q1, q2, k1, k2, v go as TMA descriptors."""
    (b, hq, tq, d), (hkv, tk), dv = q1.shape, k1.shape[1:3], v.shape[-1]
    out = _empty_like_layout(q1, (b, hq, tq, dv))
    cfg = (configs or default_diff_configs(max(d, dv), q1.dtype, large_call(q1, k1, v))).fwd
    bm, bn, bd, bdv = cfg.block_m, cfg.block_n, _block_dim(d), _block_dim(dv)
    srcs, use_tma = _sources(cfg, (q1, q2, k1, k2, v), (bm, bm, bn, bn, bn), (bd, bd, bd, bd, bdv))
    meta = _kernel_meta(cfg, q1, d, dv, power, True, USE_TMA=use_tma)
    k_norms = stacked_row_norms(k1, k2) if meta["ROW_SCALE"] else beta  # (B, Hkv, 2, Tk); beta: unused
    grid = (-(-tq // cfg.block_m), b * hq)  # ceil-division in plain ints: no triton.cdiv
    tensors = (*srcs, out, beta, gain_table(q1.device, d, tk + cfg.block_m), lam, k_norms)
    scalars = (*q1.stride(), *k1.stride(), *v.stride(), *out.stride(), hq, hq // hkv, tq, tk, scale, power)
    return grid, tensors, scalars, meta, out


def diff_triton_forward(
    q1: torch.Tensor,  # (B, Hq, Tq, D)
    q2: torch.Tensor,  # (B, Hq, Tq, D)
    k1: torch.Tensor,  # (B, Hkv, Tk, D)
    k2: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32
    lam: torch.Tensor,  # (Hq,) float32
    power: float,
    scale: float,
    configs: KernelConfigs | None = None,
) -> torch.Tensor:
    """Forward pass; returns (B, Hq, Tq, Dv) in q1's dtype. configs: tiles, warps, stages, skip_zero and TMA
    loads per kernel (default_diff_configs when None).
    A q (k) pair with different strides is matched here by match_strides (the op does it once, before)."""
    q1, q2 = match_strides(q1, q2)
    k1, k2 = match_strides(k1, k2)
    grid, tensors, scalars, meta, out = _forward_launch(q1, q2, k1, k2, v, beta, lam, power, scale, configs)
    _FWD(grid, tensors, scalars, meta)
    return out


@dataclass(frozen=True, slots=True)
class PreparedDiffForward:
    """diff_triton_forward's launch for one call signature (prepare_diff_forward), as
    triton_launch.PreparedForward is the single op's: the output, the gain table, then the kept compiled kernel."""

    compiled: object  # triton's CompiledKernel
    grid: tuple[int, int, int]
    device: int  # the CUDA device index launched on
    out_shape: tuple[int, int, int, int]  # (B, Hq, Tq, Dv)
    gains: torch.Tensor  # gain_table's table at preparation (never freed: an outgrown one is retired)
    args: tuple  # the scalars and the constexprs after the tensors

    def __call__(self, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, v: torch.Tensor,
                 beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """diff_triton_forward(q1, q2, k1, k2, v, beta, lam, power, scale) for inputs of the prepared signature."""
        out = _empty_like_layout(q1, self.out_shape)
        launch(self.compiled, self.grid, self.device,
               (q1, q2, k1, k2, v, out, beta, self.gains, lam, beta, *self.args))  # as _forward_launch's
        return out


def prepare_diff_forward(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, v: torch.Tensor,
                         beta: torch.Tensor, lam: torch.Tensor, power: float, scale: float) -> PreparedDiffForward | None:
    """diff_triton_forward(q1, q2, k1, k2, v, beta, lam, power, scale) with the default tiles, prepared for later
    calls of this signature (the caller keys it, as triton_launch.prepare_forward's). None where the q or k pair's
    strides differ (the op copies one of them), the launch scales rows (fp16: a row-norm pre-pass) or loads
    through TMA descriptors (made for each call's tensors), has not run through FastLaunch yet, or is not on the
    current device: those calls take diff_triton_forward."""
    if not (_on_current_cuda_device(q1) and _strides_match(q1, q2) and _strides_match(k1, k2)):
        return None
    d, dv = q1.shape[3], v.shape[3]
    cfg = default_diff_configs(max(d, dv), q1.dtype, large_call(q1, k1, v)).fwd
    if cfg.tma or _kernel_meta(cfg, q1, d, dv, power, True)["ROW_SCALE"]:
        return None  # descriptors to make, or a row-norm pre-pass to launch, at every call
    grid, tensors, scalars, meta, out = _forward_launch(q1, q2, k1, k2, v, beta, lam, power, scale, None)
    kept = _FWD.kept(tensors, scalars, meta)
    if kept is None:
        return None
    return PreparedDiffForward(kept[0], (*grid, 1), torch.cuda.current_device(), tuple(out.shape), tensors[7],
                               (*scalars, *kept[1]))


def diff_triton_backward(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    power: float,
    scale: float,
    dout: torch.Tensor,  # (B, Hq, Tq, Dv)
    need_dbeta: bool,
    need_dlam: bool,
    configs: KernelConfigs | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward pass: (dq1, dq2, dk1, dk2, dv, dbeta, dlam); dbeta and dlam (Hq,) are reduced
    deterministically from per-row terms, and are None unless asked for. configs: as diff_triton_forward."""
    (b, hq, tq, d), (hkv, tk), dv = q1.shape, k1.shape[1:3], v.shape[-1]
    q1, q2 = match_strides(q1, q2)
    k1, k2 = match_strides(k1, k2)
    cfgs = configs or default_diff_configs(max(d, dv), q1.dtype, large_call(q1, k1, v))
    scalars = (tq, tk, scale, power)
    bd, bdv = _block_dim(d), _block_dim(dv)
    parts = (((cfgs.bwd_dkv, 0),) if cfgs.bwd_dk2 is None  # dK1, dK2 and dV in one launch; else two:
             else ((cfgs.bwd_dkv, 3), (cfgs.bwd_dk2, 4)) if cfgs.split_maps  # one map each
             else ((cfgs.bwd_dkv, 1), (cfgs.bwd_dk2, 2)))  # dK1 and dV, then dK2
    block_m = max(cfgs.bwd_dq.block_m, *(cfg.block_m for cfg, _ in parts))
    gains = gain_table(q1.device, d, tk + block_m)  # (>= Tk + BLOCK_M,)
    dq1, dq2 = torch.empty_like(q1), torch.empty_like(q1)
    dk1, dk2, dval = torch.empty_like(k1), torch.empty_like(k1), torch.empty_like(v)

    # the norms that bound the fp16 row scales; else unused (beta is passed)
    if _kernel_meta(cfgs.bwd_dkv, q1, d, dv, power, False)["ROW_SCALE"]:
        qdo_norms = stacked_row_norms(q1, q2, dout)  # (B, Hq, 3, Tq)
        kv_norms = stacked_row_norms(k1, k2, v)  # (B, Hkv, 3, Tk)
    else:
        qdo_norms = kv_norms = beta
    inputs, cols = (q1, q2, k1, k2, v, dout), (bd, bd, bd, bd, bdv, bdv)
    for cfg, part in parts:
        bm, bn = cfg.block_m, cfg.block_n
        srcs, use_tma = _sources(cfg, inputs, (bm, bm, bn, bn, bn, bm), cols)
        _BWD_DKV(
            (-(-tk // bn), b * hkv), (*srcs, dk1, dk2, dval, beta, gains, lam, qdo_norms),
            (*q1.stride(), *k1.stride(), *v.stride(), *dout.stride(), *dk1.stride(), *dval.stride(), hkv, hq // hkv,
             *scalars),
            _kernel_meta(cfg, q1, d, dv, power, False, USE_TMA=use_tma), PART=part,
        )

    cfg = cfgs.bwd_dq
    dbeta_rows, dlam_rows = (  # (B, Hq, Tq) each; dq1: a placeholder the kernel does not touch
        torch.empty(b, hq, tq, device=q1.device, dtype=torch.float32) if need else dq1 for need in (need_dbeta, need_dlam)
    )
    bm, bn = cfg.block_m, cfg.block_n
    srcs, use_tma = _sources(cfg, inputs, (bm, bm, bn, bn, bn, bm), cols)
    _BWD_DQ(
        (-(-tq // bm), b * hq), (*srcs, dq1, dq2, dbeta_rows, dlam_rows, beta, gains, lam, kv_norms),
        (*q1.stride(), *k1.stride(), *v.stride(), *dout.stride(), *dq1.stride(), hq, hq // hkv, *scalars),
        _kernel_meta(cfg, q1, d, dv, power, False, BETA_GRAD=need_dbeta, LAM_GRAD=need_dlam, USE_TMA=use_tma),
    )
    dbeta = dbeta_rows.sum(dim=(0, 2)).to(beta.dtype) if need_dbeta else None  # (Hq,)
    dlam = dlam_rows.sum(dim=(0, 2)).to(lam.dtype) if need_dlam else None  # (Hq,)
    return dq1, dq2, dk1, dk2, dval, dbeta, dlam
