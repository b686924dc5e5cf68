"""Triton kernels of causal threshold rectified attention (forward, backward dK/dV, backward dQ/dbeta).

Notation, per (batch, query head): x_ij = scale * q_i.k_j - tau_i for key j <= pos_i (else 0),
P = ReLU(x)^p, out = P V. Backward: dP = dO V^T, dS = dP * p ReLU(x)^(p-1),
dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K, dbeta = -sum_ij dS_ij * gain_i.

Key blocks above the diagonal are never visited; blocks wholly below it run without the causal mask,
only the diagonal blocks pay for it. Accumulation is fp32; the P and dS tiles go into the tensor-core
dot in the input dtype. fp16 (ROW_SCALE) keeps them in fp16's range (ReLU(x)^p can exceed 65504 where
the output is still finite) with one power of two per output row, fixed before the loop from a bound
that holds for every tile the row meets (x_ij <= base_i = scale |q_i| max_j |k_j| + max(-tau_i, 0)):
P_ij <= base_i^p, |dS_ij| <= p |dO_i| max_j |v_j| base_i^(p-1); the norms come from the launcher. The
products then accumulate in place and the accumulator is scaled back once, after the loop. For p < 1
dS has no such bound (x^(p-1) grows without limit as x -> 0+): the backward then scales each tile by
its own row maxima (FP16_RANGE, _dot_acc), at the cost of a separate product per tile.

NaN in q, k or beta gives NaN, as ReLU(NaN) = NaN in the math; keys past a query's position are set to
x = 0 before rectifying, so their weights are exactly 0 for any q, k and beta. With SKIP_ZERO, the forward
runs every tile and writes a map of the tiles whose scores may pass tau (LIVE); each backward kernel's unmasked
loop then runs only over the tiles listed for its row (LUT, COUNTS: triton_launch.tile_lists, from that map
or from the pre-pass threshold_live_tiles_kernel), leaving out, loads included, those whose scores are all
<= -margin (P exactly 0, no NaN), or over all of them when none is left out; the diagonal tiles always run. Exact
for finite dO and v (a NaN there would reach a dead tile's dS through 0 * NaN only without skipping). With
USE_TMA, the input tiles come through TMA tensor descriptors (zero-filled out of bounds) instead of masked
pointer loads. row_norms_kernel gives the launchers the fp32 row norms of q, k, v or dO these bounds use;
tile_lists_kernel makes the backward kernels' skip_zero lists from the map.
"""

import triton
import triton.language as tl

# No module-level constants in the kernels: Triton compares each global a kernel uses with its value at
# compile time on every launch (about 1 us of host time each). Constants are literals or jit functions.


@triton.jit
def _fp16_top_exp():
    """In fp16, P / dS rows are scaled so that their largest entry (per tile) or their bound (per row) is
    at most 2**14: fp16's largest value, 65504, is just under 2**16, which leaves room for rounding."""
    return 14.0


@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, zero outside [0, n_rows) x [0, n_cols) where asked to check."""
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=(cols < n_cols)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(ptrs, value, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
    if CHECK_COLS:
        tl.store(ptrs, value, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])
    else:
        tl.store(ptrs, value, mask=(rows < n_rows)[:, None])


@triton.jit
def _seq_tile(src, b, h, start, stride_t, stride_d, n_rows, n_cols: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK_R) x columns [0, BLOCK_C) of one (batch b, head h) of a (B, H, T, D)
    tensor, zero past n_rows / n_cols: through the tensor descriptor src (USE_TMA; it zero-fills out of
    bounds), else from src, a pointer to that (batch, head), with masks where asked (CHECK_ROWS)."""
    if USE_TMA:
        return src.load([b.to(tl.int32), h.to(tl.int32), start, 0]).reshape(BLOCK_R, BLOCK_C)
    else:
        rows = start + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        return _load_tile(src + rows[:, None] * stride_t + cols[None, :] * stride_d, rows, n_rows, cols, n_cols,
                          CHECK_ROWS, BLOCK_C != n_cols)


@triton.jit
def _head_src(src, b, h, stride_b, stride_h, USE_TMA: tl.constexpr):
    """What _seq_tile reads (batch b, head h) from: the descriptor itself, or the pointer to that head."""
    if USE_TMA:
        return src
    else:
        return src + b * stride_b + h * stride_h


@triton.jit
def _as_fp32(x):
    """A float scalar argument in fp32: torch.compile passes Python floats to user kernels as fp64."""
    return tl.cast(x, tl.float32)


@triton.jit
def _gain(GAINS, pos):
    """sqrt(2 ln(pos + 1) / d) for integer positions: a load from the launcher's fp32 table GAINS
    (triton_launch.gain_table, longer than any position a kernel reaches); tau = beta * gain. Computed here
    it took ~20 instructions per position (ln's polynomial, sqrt), which the dK/dV kernels paid for every
    query tile they visit; from one table every kernel sees the same tau."""
    return tl.load(GAINS + pos)


@triton.jit
def _relu(x):
    """max(x, 0), NaN where x is NaN: one max.NaN instruction (a compare and a select before; plain
    tl.maximum would drop the NaN)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rectify(x, power, POWER_MODE: tl.constexpr):
    """ReLU(x)^p, NaN where x is NaN. POWER_MODE 1: p = 1, 2: p = 2, 0: any p > 0 (exp2(p log2 x), no bias;
    the `x <= 0` test is False for NaN)."""
    if POWER_MODE == 1:
        return _relu(x)
    elif POWER_MODE == 2:
        r = _relu(x)
        return r * r
    else:
        return tl.where(x <= 0.0, 0.0, tl.exp2(power * tl.log2(x)))


@triton.jit
def _rectify_slope(x, p_val, power, POWER_MODE: tl.constexpr):
    """(d ReLU(x)^p / dx) / p = x^(p-1) for x > 0, 0 for x <= 0, NaN for NaN x; given p_val = ReLU(x)^p.
    The factor p is left to the kernels' final scale of dQ, dK and dbeta (one multiply per element less)."""
    if POWER_MODE == 1:
        return tl.where(x <= 0.0, 0.0, tl.where(x == x, 1.0, x))
    elif POWER_MODE == 2:
        return _relu(x)  # the same op as _rectify's: compiled once
    else:
        return tl.where(x <= 0.0, 0.0, p_val / x)


@triton.jit
def _any_live(x):
    """True when some score of the tile is > 0 or NaN, i.e. its rectified tile is not all exact zeros."""
    return tl.max(tl.where(x <= 0.0, 0, 1)) > 0


@triton.jit
def _runs_plain(count, tiles):
    """Whether a skip_zero row whose list holds `count` of its `tiles` tiles runs the plain loop over all of
    them: at 7/8 or more listed. A listed tile costs more than a plain one (its index is loaded first), and
    the tiles left out add exact zeros (finite v), so a row of a random map with one tile in a hundred all
    zero is not worth listing (lit_thresh/ops/PERF.md v13)."""
    return count * 8 >= tiles * 7


@triton.jit
def _max_keep_nan(a, b):
    """max(a, b), NaN if either is (tl.max drops NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _live_tile(q, k, tau, margin, real, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """1 (int8) when a real score of the tile may exceed tau: scale q.k - tau > -margin, or NaN."""
    x = _mma(q, tl.trans(k), None, PRECISION, UPCAST) * scale - tau[:, None]  # (BLOCK_M, BLOCK_N)
    return tl.max(tl.where(real & ~(x <= -margin), 1, 0)).to(tl.int8)


@triton.jit
def threshold_live_tiles_kernel(
    Q, K, BETA, GAINS, MARGIN, LIVE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    H, GROUP, TQ, TK, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """The skip_zero tile map: LIVE (B * H, cdiv(TQ, BLOCK_M), cdiv(TK, BLOCK_N)) int8, zeroed by the
    caller, gets 1 for each causal (query tile, key tile) pair that may hold a weight. A tile is left 0
    only when every causal score of its real rows is <= -margin, MARGIN (1,) fp32 = 1e-2 |scale| max|q_i|
    max|k_j| from the launcher: above the difference between this product and a kernel's own of the same
    rows and keys (summation order; tf32's operand rounding, up to ~2e-3 relative, included), so no tile
    with a weight is ever marked 0; a NaN score marks it 1. Only QK^T: no V, no output. Grid
    (cdiv(TQ, BLOCK_M), B * H)."""
    scale = _as_fp32(scale)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    past = TK - TQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _seq_tile(Q + b * stride_qb + h * stride_qh, b, h, pid_m * BLOCK_M, stride_qt, stride_qd,
                  TQ, D, BLOCK_M, BLOCK_D, True, False)  # (BLOCK_M, BLOCK_D)
    pos = offs_m + past
    tau = tl.load(BETA + h) * _gain(GAINS, pos)  # (BLOCK_M,)
    margin = tl.load(MARGIN)
    row_real = (offs_m < TQ)[:, None]  # (BLOCK_M, 1)
    k_src = K + b * stride_kb + (h // GROUP) * stride_kh
    live_row = LIVE + (pid_bh.to(tl.int64) * tl.cdiv(TQ, BLOCK_M) + pid_m) * tl.cdiv(TK, BLOCK_N)
    first_row = past + pid_m * BLOCK_M
    n_full = (first_row + 1) // BLOCK_N * BLOCK_N  # keys [0, n_full) are visible to every row
    n_end = tl.minimum(first_row + BLOCK_M, TK)
    for start_n in range(0, n_full, BLOCK_N):
        k = _seq_tile(k_src, b, h, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, False, False)  # (BLOCK_N, BLOCK_D)
        tl.store(live_row + start_n // BLOCK_N, _live_tile(q, k, tau, margin, row_real, scale, PRECISION, UPCAST))
    for start_n in range(n_full, n_end, BLOCK_N):  # the diagonal tiles, causal mask
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _seq_tile(k_src, b, h, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, True, False)
        real = row_real & (offs_n[None, :] <= pos[:, None])  # keys past TK lie past every real row's pos
        tl.store(live_row + start_n // BLOCK_N, _live_tile(q, k, tau, margin, real, scale, PRECISION, UPCAST))


@triton.jit
def tile_lists_kernel(
    LIVE, LISTS, COUNTS,
    stride_lh, stride_lr, stride_lc,
    MAP_R, MAP_C, ROWS, LENGTH, TQ, TK,
    ROW_TILE: tl.constexpr, ROW_GRAIN: tl.constexpr, COL_TILE: tl.constexpr, COL_GRAIN: tl.constexpr,
    BY_KEY: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """A backward kernel's skip_zero work lists from the tile map LIVE, read as (B * H, MAP_R, MAP_C) through
    its strides (the dK/dV kernel's rows are key tiles: the map transposed). Row r of head bh lists, in
    ascending order, the tiles c (of COL_TILE positions) of that kernel's unmasked loop that overlap a live map
    tile (of ROW_GRAIN x COL_GRAIN positions): LISTS (B * H * ROWS, LENGTH) int32, the first COUNTS[row] entries;
    0 after them. Tile sizes are powers of two times the map's grain, either way. BY_KEY: row r is key tile r,
    listing query tiles from the first wholly unmasked one (threshold_bwd_dkv_kernel); else query tile r,
    listing key tiles below the diagonal (threshold_bwd_dq_kernel). Grid (ROWS, B * H)."""
    r = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    past = TK - TQ
    if BY_KEY:  # query tiles from m_full on; ROW_TILE = BLOCK_N, COL_TILE = BLOCK_M
        m_full = tl.minimum((tl.maximum(r * ROW_TILE + ROW_TILE - 1 - past, 0) + COL_TILE - 1) // COL_TILE * COL_TILE, TQ)
        lo, hi = (m_full + COL_TILE - 1) // COL_TILE, LENGTH
    else:  # key tiles below n_full; ROW_TILE = BLOCK_M, COL_TILE = BLOCK_N
        lo, hi = 0, (past + r * ROW_TILE + 1) // COL_TILE
    map_row = LIVE + bh * stride_lh
    out = LISTS + (bh * ROWS + r) * LENGTH
    count = 0
    for start in range(0, LENGTH, BLOCK_L):
        c = start + tl.arange(0, BLOCK_L)  # (BLOCK_L,) the list's tiles
        live = tl.zeros((BLOCK_L,), dtype=tl.int32)
        for i in tl.static_range(max(ROW_TILE // ROW_GRAIN, 1)):  # the map tiles a kernel tile overlaps
            mr = r * ROW_TILE // ROW_GRAIN + i
            cols = tl.where(mr < MAP_R, MAP_C, 0)  # the map's columns in row mr (none past its last row)
            for j in tl.static_range(max(COL_TILE // COL_GRAIN, 1)):
                mc = c * COL_TILE // COL_GRAIN + j
                x = tl.load(map_row + mr * stride_lr + mc * stride_lc, mask=mc < cols, other=0)
                live = live | (x != 0).to(tl.int32)
        live = live & ((c >= lo) & (c < hi)).to(tl.int32)
        rank = count + tl.cumsum(live, 0) - live  # (BLOCK_L,) each live tile's place in the list
        tl.store(out + rank, c, mask=live != 0)
        count += tl.sum(live, 0)
    for start in range(0, LENGTH, BLOCK_L):  # zeros after the count, as the kernels never read
        c = start + tl.arange(0, BLOCK_L)
        tl.store(out + c, tl.zeros((BLOCK_L,), dtype=tl.int32), mask=(c >= count) & (c < LENGTH))
    tl.store(COUNTS + bh * ROWS + r, count)


@triton.jit
def _tile_list(LUT, COUNTS, row, row_len, SKIP_ZERO: tl.constexpr):
    """SKIP_ZERO: (pointer to row `row` of the tile lists LUT (rows of row_len int32), its length); else
    (LUT, 0), unused."""
    if SKIP_ZERO:
        return LUT + row * row_len, tl.load(COUNTS + row)
    else:
        return LUT, 0


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b on tensor cores. UPCAST (the interpreter with bf16 only: it cannot multiply bf16)
    multiplies the same bf16-rounded values in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _dot_acc(a, b, acc, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with the fp32 tile a cast to b's dtype (kept in fp16's range when FP16_RANGE)."""
    if FP16_RANGE:
        amax = tl.max(tl.abs(a), axis=1)  # (M,)
        row_exp = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0))) - _fp16_top_exp(), 0.0)  # (M,)
        prod = _mma((a * tl.exp2(-row_exp)[:, None]).to(b.dtype), b, None, PRECISION, UPCAST)  # exact power-of-2 scaling
        return acc + tl.exp2(row_exp)[:, None] * prod
    else:
        return _mma(a.to(b.dtype), b, acc, PRECISION, UPCAST)


@triton.jit
def _dot_rows(a, row_mul, b, acc, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    """acc + a @ b with the fp32 tile a cast to b's dtype: its rows first multiplied by row_mul (fixed fp16
    row scales) where ROW_SCALE, else as _dot_acc (row_mul unused)."""
    if ROW_SCALE:
        return _mma((a * row_mul[:, None]).to(b.dtype), b, acc, PRECISION, UPCAST)
    else:
        return _dot_acc(a, b, acc, FP16_RANGE, PRECISION, UPCAST)


@triton.jit
def _row_norms(x):
    """Euclidean norms of the rows of a 2-D tile, in fp32. (R,)"""
    xf = x.to(tl.float32)
    return tl.sqrt(tl.sum(xf * xf, axis=1))


@triton.jit
def row_norms_kernel(
    X, OUT, H, T,
    stride_xb, stride_xh, stride_xt, stride_xd,
    stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """OUT[b, h, t] = |X[b, h, t, :]| in fp32, for a (B, H, T, D) X of any strides: the norms the fp16 row
    scales and the skip_zero margin are bounded by. Grid (cdiv(T, BLOCK_T), B * H)."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    x = _load_tile(X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xt + cols[None, :] * stride_xd,
                   rows, T, cols, D, True, BLOCK_D != D)  # (BLOCK_T, BLOCK_D)
    tl.store(OUT + b * stride_ob + h * stride_oh + rows * stride_ot, _row_norms(x), mask=rows < T)


@triton.jit
def _finite_max(ptr, lo, hi):
    """The largest finite value of the fp32 norms ptr[lo:hi], 0 if none. A row with an inf or NaN entry
    makes its products inf, NaN or exactly 0 whatever the scale, so its norm is left out rather than
    turning the bound of every row it meets into inf or NaN."""
    m = tl.zeros((256,), dtype=tl.float32)
    for start in range(lo, hi, 256):
        offs = start + tl.arange(0, 256)
        n = tl.load(ptr + offs, mask=offs < hi, other=0.0)
        m = tl.maximum(m, tl.where(n <= 3.0e38, n, 0.0))  # the test is False for inf and NaN
    return tl.max(m, axis=0)


@triton.jit
def _log2_weight_bound(base, power, POWER_MODE: tl.constexpr):
    """log2(base^p): the bound of ReLU(x)^p for x <= base."""
    if POWER_MODE == 1:
        return tl.log2(base)
    elif POWER_MODE == 2:
        return 2.0 * tl.log2(base)
    else:
        return power * tl.log2(base)


@triton.jit
def _log2_grad_bound(base, log2_dp, power, POWER_MODE: tl.constexpr):
    """log2(2^log2_dp * base^(p-1)): the bound of |dS| / p = |dP| _rectify_slope(x) for |dP| <= 2^log2_dp,
    x <= base and p >= 1."""
    if POWER_MODE == 1:
        return log2_dp
    elif POWER_MODE == 2:
        return log2_dp + tl.log2(base)
    else:
        return log2_dp + (power - 1.0) * tl.log2(base)


@triton.jit
def _fp16_exp(log2_bound):
    """Row exponents e with bound * 2^-e <= 2^14 (_fp16_top_exp), within [-100, 114]: 2^e and 2^-e are
    normal fp32 numbers, and any finite fp32 value (< 2^128) times 2^-114 is at most 2^14. e = 0 (no
    scaling) where log2_bound is not finite: a zero bound (all those products are 0), or an inf or NaN
    one, which comes from an inf or NaN q or dO row or beta (products inf, NaN or 0 whatever the scale)
    or from scale * |q| * max |k| past fp32's range (no bound to use: unscaled, as before)."""
    e = tl.minimum(tl.maximum(tl.ceil(log2_bound) - _fp16_top_exp(), -100.0), 114.0)
    return tl.where(tl.abs(log2_bound) <= 3.0e38, e, 0.0)


@triton.jit
def _fwd_tile(
    acc, q, tau, p_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, start_n, map_row, live_cut,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, P_SCALED: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WRITE_MAP: tl.constexpr, USE_TMA: tl.constexpr,
):
    """acc + P V of the key tile at start_n. WRITE_MAP: map_row[start_n / BLOCK_N] = 1 (int8) when a score
    of the tile is > live_cut (a scalar or (BLOCK_M,)) or NaN; each such row stores the same byte, so the
    rows need not agree first (no cross-warp reduction in the loop)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _seq_tile(k_src, b, hk, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, CAUSAL_MASK, USE_TMA)  # (BLOCK_N, BLOCK_D)
    v = _seq_tile(v_src, b, hk, start_n, stride_vt, stride_vd, TK, DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, USE_TMA)  # (BLOCK_N, BLOCK_DV)
    x = _mma(q, tl.trans(k), None, PRECISION, UPCAST) * scale - tau[:, None]  # (BLOCK_M, BLOCK_N)
    if WRITE_MAP:
        top = x
        if CAUSAL_MASK:
            top = tl.where(offs_n[None, :] <= pos[:, None], x, float("-inf"))
        top = tl.reduce(top, 1, _max_keep_nan)  # (BLOCK_M,) each row's largest score, NaN if any
        tl.store(map_row + start_n // BLOCK_N + tl.zeros(top.shape, tl.int32), tl.full(top.shape, 1, tl.int8),
                 mask=~(top <= live_cut))
    if CAUSAL_MASK:
        x = tl.where(offs_n[None, :] <= pos[:, None], x, 0.0)
    return _dot_rows(_rectify(x, power, POWER_MODE), p_mul, v, acc, P_SCALED, False, PRECISION, UPCAST)


@triton.jit
def _fwd_inner(
    acc, q, tau, p_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, map_row, live_cut, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, P_SCALED: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WRITE_MAP: tl.constexpr, USE_TMA: tl.constexpr,
):
    """acc + P V over key tiles [lo, hi); scale: a scalar or (BLOCK_M, 1) row scales; P_SCALED: P's rows
    are multiplied by p_mul (BLOCK_M,) before the cast. WRITE_MAP: the tiles' skip_zero map bytes too."""
    for start_n in range(lo, hi, BLOCK_N):
        acc = _fwd_tile(acc, q, tau, p_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
                        TK, scale, power, start_n, map_row, live_cut, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL_MASK,
                        POWER_MODE, P_SCALED, PRECISION, UPCAST, WRITE_MAP, USE_TMA)
    return acc


@triton.jit
def threshold_fwd_kernel(
    Q, K, V, O, BETA, GAINS, ROW_NORMS, MARGIN, LIVE,
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
    ROW_SCALE (fp16): P rows scaled into fp16's range by a power of two per row, from the key norms
    ROW_NORMS (B * H / GROUP, TK) fp32 (unused otherwise). SKIP_ZERO: every tile still runs, and the kernel
    writes the skip_zero map the backward's work lists come from: LIVE (B * H, cdiv(TQ, BLOCK_M),
    cdiv(TK, BLOCK_N)) int8, zeroed by the caller, gets 1 where a score of the tile is > -margin or NaN
    (MARGIN (1,) fp32, as threshold_live_tiles_kernel's; padding rows may mark a tile, which only keeps
    it). USE_TMA: Q, K, V are (B, H, T, D) tensor descriptors."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    past = TK - TQ

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _seq_tile(_head_src(Q, b, h, stride_qb, stride_qh, USE_TMA), b, h, pid_m * BLOCK_M, stride_qt, stride_qd,
                  TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    pos = offs_m + past  # absolute positions (BLOCK_M,)
    tau = tl.load(BETA + h) * _gain(GAINS, pos)  # (BLOCK_M,)

    k_src = _head_src(K, b, hk, stride_kb, stride_kh, USE_TMA)
    v_src = _head_src(V, b, hk, stride_vb, stride_vh, USE_TMA)
    first_row = past + pid_m * BLOCK_M
    n_full = (first_row + 1) // BLOCK_N * BLOCK_N  # keys [0, n_full) are visible to every row
    n_end = tl.minimum(first_row + BLOCK_M, TK)  # no row sees a key at or past n_end

    x_scale = scale
    p_mul = tau  # unused unless ROW_SCALE with POWER_MODE 0
    live_cut = scale  # unused unless SKIP_ZERO: scores at or below it leave the map's byte 0
    if SKIP_ZERO:
        live_cut = -tl.load(MARGIN)
    if ROW_SCALE:
        k_max = _finite_max(ROW_NORMS + (b * (H // GROUP) + hk) * TK, 0, n_end)  # over the keys these rows meet
        base = tl.abs(scale) * _row_norms(q) * k_max + tl.maximum(-tau, 0.0)  # (BLOCK_M,) >= every score of the row
        e = _fp16_exp(_log2_weight_bound(base, power, POWER_MODE))  # (BLOCK_M,)
        if POWER_MODE == 0:
            p_mul = tl.exp2(-e)
        else:  # folded into the scores, free: ReLU(x 2^(-e/p))^p = P 2^-e exactly (e even for p = 2)
            if POWER_MODE == 2:
                e = 2.0 * tl.ceil(0.5 * e)
            row_scale = tl.exp2(-e / POWER_MODE)  # (BLOCK_M,)
            x_scale = (scale * row_scale)[:, None]  # (BLOCK_M, 1)
            tau = tau * row_scale
            if SKIP_ZERO:  # the scores are scaled, so is their cut
                live_cut = live_cut * row_scale  # (BLOCK_M,)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    map_row = LIVE + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * tl.cdiv(TK, BLOCK_N)  # unused unless SKIP_ZERO
    acc = _fwd_inner(acc, q, tau, p_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
                     TK, x_scale, power, map_row, live_cut, 0, n_full, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                     False, POWER_MODE, ROW_SCALE and POWER_MODE == 0, PRECISION, UPCAST, SKIP_ZERO, USE_TMA)
    acc = _fwd_inner(acc, q, tau, p_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
                     TK, x_scale, power, map_row, live_cut, n_full, n_end, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                     True, POWER_MODE, ROW_SCALE and POWER_MODE == 0, PRECISION, UPCAST, SKIP_ZERO, USE_TMA)
    if ROW_SCALE:
        acc = acc * tl.exp2(e)[:, None]

    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :] * stride_od
    _store_tile(o_ptrs, acc.to(O.dtype.element_ty), offs_m, TQ, offs_dv, DV, DV != BLOCK_DV)


@triton.jit
def _bwd_dkv_update(dk, dv, x_t, q, do, v, power, p_mul, ds_mul, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr,
                    FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dK, dV accumulators after one (key tile, query tile) pair with transposed scores x_t (BLOCK_N, BLOCK_M);
    with ROW_SCALE, the rows of P^T and dS^T are multiplied by p_mul and ds_mul (BLOCK_N,) first."""
    p_t = _rectify(x_t, power, POWER_MODE)
    dv = _dot_rows(p_t, p_mul, do, dv, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_DV)
    dp_t = _mma(v, tl.trans(do), None, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_M)
    ds_t = dp_t * _rectify_slope(x_t, p_t, power, POWER_MODE)  # dS^T / p
    dk = _dot_rows(ds_t, ds_mul, q, dk, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit
def _bwd_dkv_tile(
    dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
    beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, start_m,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dK, dV accumulators after the query tile at start_m."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _seq_tile(q_src, b, h, start_m, stride_qt, stride_qd, TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    do = _seq_tile(do_src, b, h, start_m, stride_dot, stride_dod, TQ, DV, BLOCK_M, BLOCK_DV, True, USE_TMA)  # (BLOCK_M, BLOCK_DV)
    pos = offs_m + past
    tau = beta * _gain(GAINS, pos)  # (BLOCK_M,)
    x_t = _mma(k, tl.trans(q), None, PRECISION, UPCAST) * scale - tau[None, :]  # (BLOCK_N, BLOCK_M)
    if CAUSAL_MASK:
        x_t = tl.where(offs_n[:, None] <= pos[None, :], x_t, 0.0)
    return _bwd_dkv_update(dk, dv, x_t, q, do, v, power, p_mul, ds_mul, POWER_MODE, ROW_SCALE, FP16_RANGE,
                           PRECISION, UPCAST)


@triton.jit
def _bwd_dkv_range(
    dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
    beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dK, dV accumulators after every query tile in [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        dk, dv = _bwd_dkv_tile(dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot,
                               stride_dod, beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, start_m,
                               D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL_MASK, POWER_MODE, ROW_SCALE,
                               FP16_RANGE, PRECISION, UPCAST, USE_TMA)
    return dk, dv


@triton.jit
def _bwd_dkv_inner(
    dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
    beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, lut, count, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SKIP_ZERO: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Over query tiles [lo, hi); SKIP_ZERO: instead only the count query tiles listed (ascending tile
    indices) at lut, decided before any load, unless that is nearly every tile (_runs_plain); both loops
    at the top level, as in _bwd_dq_inner."""
    plain_hi = hi
    if SKIP_ZERO:
        full = _runs_plain(count, tl.cdiv(hi - lo, BLOCK_M))
        for i in range(0, tl.where(full, 0, count)):
            start_m = tl.multiple_of(tl.load(lut + i) * BLOCK_M, BLOCK_M)
            dk, dv = _bwd_dkv_tile(dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot,
                                   stride_dod, beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, start_m,
                                   D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL_MASK, POWER_MODE, ROW_SCALE,
                                   FP16_RANGE, PRECISION, UPCAST, USE_TMA)
        plain_hi = tl.where(full, hi, lo)
    dk, dv = _bwd_dkv_range(dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot,
                            stride_dod, beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, lo, plain_hi,
                            D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, CAUSAL_MASK, POWER_MODE, ROW_SCALE,
                            FP16_RANGE, PRECISION, UPCAST, USE_TMA)
    return dk, dv


@triton.jit
def threshold_bwd_dkv_kernel(
    Q, K, V, dO, dK, dV, BETA, GAINS, ROW_NORMS, LUT, COUNTS,
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
    UPCAST: tl.constexpr, SKIP_ZERO: tl.constexpr = False, USE_TMA: tl.constexpr = False,
):
    """One program: BLOCK_N keys of one (batch, kv head), summing over the GROUP query heads that share
    them (no atomics). Grid (cdiv(TK, BLOCK_N), B * HKV). ROW_SCALE (fp16, p >= 1): the rows of P^T and
    dS^T scaled into fp16's range by a power of two per key, from the query and dO row norms ROW_NORMS
    (B * HKV * GROUP, 2, TQ) fp32 (unused otherwise); FP16_RANGE (fp16, p < 1): per-tile scaling instead.
    SKIP_ZERO: the unmasked loop visits only the query tiles listed in LUT (a row of cdiv(TQ, BLOCK_M) per
    (batch, query head, key tile); COUNTS: how many), or all of them where >= 7/8 are listed (_runs_plain).
    USE_TMA: Q, K, V, dO are tensor descriptors."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    past = TK - TQ

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _seq_tile(_head_src(K, b, hk, stride_kb, stride_kh, USE_TMA), b, hk, pid_n * BLOCK_N, stride_kt, stride_kd,
                  TK, D, BLOCK_N, BLOCK_D, True, USE_TMA)  # (BLOCK_N, BLOCK_D)
    v = _seq_tile(_head_src(V, b, hk, stride_vb, stride_vh, USE_TMA), b, hk, pid_n * BLOCK_N, stride_vt, stride_vd,
                  TK, DV, BLOCK_N, BLOCK_DV, True, USE_TMA)  # (BLOCK_N, BLOCK_DV)

    first_key = pid_n * BLOCK_N
    # query rows m see the block when pos_m >= first_key, all of it when pos_m >= first_key + BLOCK_N - 1
    m_lo = tl.maximum(first_key - past, 0) // BLOCK_M * BLOCK_M
    m_full = tl.minimum(tl.cdiv(tl.maximum(first_key + BLOCK_N - 1 - past, 0), BLOCK_M) * BLOCK_M, TQ)

    p_mul = scale  # unused unless ROW_SCALE
    ds_mul = scale
    if ROW_SCALE:  # bounds over the rows of every query head of the group that see these keys
        q_max = tl.zeros((), dtype=tl.float32)
        do_max = tl.zeros((), dtype=tl.float32)
        neg_beta = tl.zeros((), dtype=tl.float32)
        for g in range(GROUP):
            h = hk * GROUP + g
            norms = ROW_NORMS + (b * HKV * GROUP + h) * 2 * TQ  # |q_i| then |dO_i| of head h
            q_max = tl.maximum(q_max, _finite_max(norms, tl.maximum(first_key - past, 0), TQ))
            do_max = tl.maximum(do_max, _finite_max(norms + TQ, tl.maximum(first_key - past, 0), TQ))
            neg_beta = tl.maximum(neg_beta, -tl.load(BETA + h))
        # (1,): -tau is largest at the last position a query tile reaches, padding rows past TQ included
        neg_tau = neg_beta * _gain(GAINS, tl.full((1,), TK - 1 + BLOCK_M, tl.int32))
        base = tl.abs(scale) * q_max * _row_norms(k) + neg_tau  # (BLOCK_N,) >= every score of the key
        p_exp = _fp16_exp(_log2_weight_bound(base, power, POWER_MODE))  # (BLOCK_N,)
        ds_exp = _fp16_exp(_log2_grad_bound(base, tl.log2(do_max) + tl.log2(_row_norms(v)), power, POWER_MODE))
        p_mul = tl.exp2(-p_exp)
        ds_mul = tl.exp2(-ds_exp)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        beta = tl.load(BETA + h)
        q_src = _head_src(Q, b, h, stride_qb, stride_qh, USE_TMA)
        do_src = _head_src(dO, b, h, stride_dob, stride_doh, USE_TMA)
        lut, count = _tile_list(LUT, COUNTS, (b * HKV * GROUP + h) * tl.num_programs(0) + pid_n, tl.cdiv(TQ, BLOCK_M),
                                SKIP_ZERO)
        dk, dv = _bwd_dkv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
                                beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, lut, count, m_lo, m_full,
                                D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                True, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, False, USE_TMA)
        dk, dv = _bwd_dkv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, stride_qt, stride_qd, stride_dot, stride_dod,
                                beta, past, TQ, scale, power, GAINS, p_mul, ds_mul, lut, count, m_full, TQ,
                                D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                False, POWER_MODE, ROW_SCALE, FP16_RANGE, PRECISION, UPCAST, SKIP_ZERO, USE_TMA)
    dk = dk * (scale * power)  # the p of dS (_rectify_slope)
    if ROW_SCALE:
        dk = dk * tl.exp2(ds_exp)[:, None]
        dv = dv * tl.exp2(p_exp)[:, None]

    dk_ptrs = dK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    dv_ptrs = dV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :] * stride_dvd
    _store_tile(dk_ptrs, dk.to(dK.dtype.element_ty), offs_n, TK, offs_d, D, D != BLOCK_D)
    _store_tile(dv_ptrs, dv.to(dV.dtype.element_ty), offs_n, TK, offs_dv, DV, DV != BLOCK_DV)


@triton.jit
def _bwd_dq_update(dq, ds_sum, x, do, k, v, power, ds_mul, POWER_MODE: tl.constexpr, DS_SCALED: tl.constexpr,
                   FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr):
    """dQ accumulator and per-row dS sums after one (query tile, key tile) pair with scores x (BLOCK_M, BLOCK_N);
    DS_SCALED: dS rows are multiplied by ds_mul (BLOCK_M,) before the cast (not in the sums)."""
    dp = _mma(do, tl.trans(v), None, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_N)
    ds = dp * _rectify_slope(x, _rectify(x, power, POWER_MODE), power, POWER_MODE)  # dS / p
    dq = _dot_rows(ds, ds_mul, k, dq, DS_SCALED, FP16_RANGE, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_D)
    if BETA_GRAD:
        ds_sum += tl.sum(ds, axis=1)
    return dq, ds_sum


@triton.jit
def _bwd_dq_tile(
    dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, start_n,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, DS_SCALED: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dQ accumulator and dS row sums after the key tile at start_n; scale: a scalar or (BLOCK_M, 1)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _seq_tile(k_src, b, hk, start_n, stride_kt, stride_kd, TK, D, BLOCK_N, BLOCK_D, CAUSAL_MASK, USE_TMA)  # (BLOCK_N, BLOCK_D)
    v = _seq_tile(v_src, b, hk, start_n, stride_vt, stride_vd, TK, DV, BLOCK_N, BLOCK_DV, CAUSAL_MASK, USE_TMA)  # (BLOCK_N, BLOCK_DV)
    x = _mma(q, tl.trans(k), None, PRECISION, UPCAST) * scale - tau[:, None]  # (BLOCK_M, BLOCK_N)
    if CAUSAL_MASK:
        x = tl.where(offs_n[None, :] <= pos[:, None], x, 0.0)
    return _bwd_dq_update(dq, ds_sum, x, do, k, v, power, ds_mul, POWER_MODE, DS_SCALED, FP16_RANGE, PRECISION,
                          UPCAST, BETA_GRAD)


@triton.jit
def _bwd_dq_range(
    dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, DS_SCALED: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dQ accumulator and dS row sums after every key tile in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        dq, ds_sum = _bwd_dq_tile(dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd,
                                  stride_vt, stride_vd, TK, scale, power, start_n, D, DV, BLOCK_D, BLOCK_DV,
                                  BLOCK_N, CAUSAL_MASK, POWER_MODE, DS_SCALED, FP16_RANGE, PRECISION, UPCAST,
                                  BETA_GRAD, USE_TMA)
    return dq, ds_sum


@triton.jit
def _bwd_dq_inner(
    dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt, stride_vd,
    TK, scale, power, lut, count, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, POWER_MODE: tl.constexpr, DS_SCALED: tl.constexpr, FP16_RANGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, SKIP_ZERO: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Over key tiles [lo, hi); scale: a scalar or (BLOCK_M, 1) row scales. SKIP_ZERO: instead only the
    count key tiles listed (ascending tile indices) at lut, decided before any load, unless that is nearly
    every tile (_runs_plain). Both loops sit at the top level, one of them with no trips, not one in each
    branch of an if (lit_thresh/ops/PERF.md v12)."""
    plain_hi = hi
    if SKIP_ZERO:
        full = _runs_plain(count, tl.cdiv(hi - lo, BLOCK_N))
        for i in range(0, tl.where(full, 0, count)):
            start_n = tl.multiple_of(tl.load(lut + i) * BLOCK_N, BLOCK_N)
            dq, ds_sum = _bwd_dq_tile(dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt,
                                      stride_kd, stride_vt, stride_vd, TK, scale, power, start_n, D, DV, BLOCK_D,
                                      BLOCK_DV, BLOCK_N, CAUSAL_MASK, POWER_MODE, DS_SCALED, FP16_RANGE, PRECISION,
                                      UPCAST, BETA_GRAD, USE_TMA)
        plain_hi = tl.where(full, hi, lo)
    dq, ds_sum = _bwd_dq_range(dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd,
                               stride_vt, stride_vd, TK, scale, power, lo, plain_hi, D, DV, BLOCK_D, BLOCK_DV,
                               BLOCK_N, CAUSAL_MASK, POWER_MODE, DS_SCALED, FP16_RANGE, PRECISION, UPCAST,
                               BETA_GRAD, USE_TMA)
    return dq, ds_sum


@triton.jit
def threshold_bwd_dq_kernel(
    Q, K, V, dO, dQ, DBETA_ROWS, BETA, GAINS, ROW_NORMS, LUT, COUNTS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    H, GROUP, TQ, TK, scale, power,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, ROW_SCALE: tl.constexpr, FP16_RANGE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BETA_GRAD: tl.constexpr, SKIP_ZERO: tl.constexpr = False, USE_TMA: tl.constexpr = False,
):
    """One program: dQ of BLOCK_M queries of one (batch, head), and their per-row dbeta terms
    -gain_i * sum_j dS_ij into DBETA_ROWS (B * H, TQ), summed on the host. Grid (cdiv(TQ, BLOCK_M), B * H).
    ROW_SCALE (fp16, p >= 1): dS rows scaled into fp16's range by a power of two per row, from the key and
    value norms ROW_NORMS (B * H / GROUP, 2, TK) fp32 (unused otherwise); FP16_RANGE (fp16, p < 1):
    per-tile scaling instead. SKIP_ZERO: the unmasked loop visits only the key tiles listed in LUT (a row of
    cdiv(TK, BLOCK_N) per (batch, head, query tile); COUNTS: how many), or all of them where >= 7/8 are listed.
    USE_TMA: Q, K, V, dO are tensor descriptors."""
    scale, power = _as_fp32(scale), _as_fp32(power)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    past = TK - TQ

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _seq_tile(_head_src(Q, b, h, stride_qb, stride_qh, USE_TMA), b, h, pid_m * BLOCK_M, stride_qt, stride_qd,
                  TQ, D, BLOCK_M, BLOCK_D, True, USE_TMA)  # (BLOCK_M, BLOCK_D)
    do = _seq_tile(_head_src(dO, b, h, stride_dob, stride_doh, USE_TMA), b, h, pid_m * BLOCK_M, stride_dot, stride_dod,
                   TQ, DV, BLOCK_M, BLOCK_DV, True, USE_TMA)  # (BLOCK_M, BLOCK_DV)
    pos = offs_m + past
    gain = _gain(GAINS, pos)
    tau = tl.load(BETA + h) * gain  # (BLOCK_M,)

    k_src = _head_src(K, b, hk, stride_kb, stride_kh, USE_TMA)
    v_src = _head_src(V, b, hk, stride_vb, stride_vh, USE_TMA)
    first_row = past + pid_m * BLOCK_M
    n_full = (first_row + 1) // BLOCK_N * BLOCK_N
    n_end = tl.minimum(first_row + BLOCK_M, TK)

    x_scale = scale
    ds_mul = tau  # unused unless ROW_SCALE with POWER_MODE != 2
    if ROW_SCALE:
        norms = ROW_NORMS + (b * (H // GROUP) + hk) * 2 * TK  # |k_j| then |v_j| of this kv head
        k_max = _finite_max(norms, 0, n_end)  # over the keys these rows meet
        v_max = _finite_max(norms + TK, 0, n_end)
        base = tl.abs(scale) * _row_norms(q) * k_max + tl.maximum(-tau, 0.0)  # (BLOCK_M,) >= every score of the row
        ds_exp = _fp16_exp(_log2_grad_bound(base, tl.log2(_row_norms(do)) + tl.log2(v_max), power, POWER_MODE))
        if POWER_MODE == 2:  # folded into the scores, free: dS / p = dP x scales with x (dbeta sums too)
            x_scale = (scale * tl.exp2(-ds_exp))[:, None]  # (BLOCK_M, 1)
            tau = tau * tl.exp2(-ds_exp)
        else:
            ds_mul = tl.exp2(-ds_exp)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    ds_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lut, count = _tile_list(LUT, COUNTS, pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, tl.cdiv(TK, BLOCK_N),
                            SKIP_ZERO)
    dq, ds_sum = _bwd_dq_inner(dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt,
                               stride_vd, TK, x_scale, power, lut, count, 0, n_full, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                               False, POWER_MODE, ROW_SCALE and POWER_MODE != 2, FP16_RANGE, PRECISION, UPCAST,
                               BETA_GRAD, SKIP_ZERO, USE_TMA)
    dq, ds_sum = _bwd_dq_inner(dq, ds_sum, q, do, tau, ds_mul, pos, k_src, v_src, b, hk, stride_kt, stride_kd, stride_vt,
                               stride_vd, TK, x_scale, power, lut, count, n_full, n_end, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                               True, POWER_MODE, ROW_SCALE and POWER_MODE != 2, FP16_RANGE, PRECISION, UPCAST,
                               BETA_GRAD, False, USE_TMA)
    dq = dq * (scale * power)  # the p of dS (_rectify_slope)
    if ROW_SCALE:
        dq = dq * tl.exp2(ds_exp)[:, None]
        if POWER_MODE == 2:
            ds_sum = ds_sum * tl.exp2(ds_exp)

    dq_ptrs = dQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    _store_tile(dq_ptrs, dq.to(dQ.dtype.element_ty), offs_m, TQ, offs_d, D, D != BLOCK_D)
    if BETA_GRAD:
        tl.store(DBETA_ROWS + pid_bh.to(tl.int64) * TQ + offs_m, -(gain * power) * ds_sum, mask=offs_m < TQ)
