"""Launchers of the Triton threshold attention kernels: block configs, grids, output allocation."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
import triton

from lit_thresh.ops.backend import triton_interpreting
from lit_thresh.ops.fast_launch import FastLaunch, launch
from lit_thresh.ops.triton_kernels import (
    row_norms_kernel,
    threshold_bwd_dkv_kernel,
    threshold_bwd_dq_kernel,
    threshold_fwd_kernel,
    threshold_live_tiles_kernel,
    tile_lists_kernel,
)

_FWD, _BWD_DKV, _BWD_DQ = map(FastLaunch, (threshold_fwd_kernel, threshold_bwd_dkv_kernel, threshold_bwd_dq_kernel))
_NORMS, _LISTS = FastLaunch(row_norms_kernel), FastLaunch(tile_lists_kernel)


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of one kernel. skip_zero, exact either way: in the backward kernels,
    the unmasked loop runs over a list of the tiles whose rectified scores may be nonzero (tile_lists),
    loads included, from the map the forward wrote (or a QK^T pre-pass, live_tiles, without one); a row
    whose list holds at least 7/8 of its tiles runs the plain loop over all of them. In the forward, every
    tile runs and the kernel writes that map. The differential op's kernels check each tile in their loop
    instead. Measured on one H200: lit_thresh/ops/PERF.md (v7, v13).
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
    """One config per kernel. bwd_dk2 (the differential op only): None, or the tiles of a second dK/dV
    launch that computes dK2 alone, the first (bwd_dkv) then computing dK1 and dV: two lighter kernels instead
    of one with three accumulators. split_maps (with bwd_dk2): each launch reads one map, as a single op's
    dK/dV kernel does: the first dK1 and map 1's term of dV, the second dK2 and map 2's, added to the first's."""

    fwd: BlockConfig
    bwd_dkv: BlockConfig
    bwd_dq: BlockConfig
    bwd_dk2: BlockConfig | None = None
    split_maps: bool = False


SHORT_KEYS = (1024, 2048)
"""Key lengths Tk up to which the default tiles of short maps apply: length class 0 (Tk <= 1024), 1 (<= 2048),
2 (longer). At T = 1024 and 2048 (B * T = 16384, H = 16, one H100; lit_thresh/ops/PERF.md v21) smaller tiles
are faster: at D = 128 the forward at 64x64 w4 took 0.90x the time of 128x64 w8 at T = 1024 and 0.97-0.99x at
T = 2048 (1.02-1.17x from T = 4096), and the dK/dV kernel at 32x64 w4 took 0.97x the backward's time of
64x128 w8 at T = 1024 (1.01x at T = 2048); fp16 D = 64's dK/dV at 32x64 w4 0.96x of 64x64 w4's at T = 1024
(0.98x at T = 2048)."""


def length_class(tk: int) -> int:
    """The default tiles' length class of a call with tk keys (SHORT_KEYS)."""
    return 0 if tk <= SHORT_KEYS[0] else 1 if tk <= SHORT_KEYS[1] else 2


def default_configs(head_dim: int, dtype: torch.dtype, tk: int | None = None) -> KernelConfigs:
    """Tiles per kernel for the larger of the q/k and v head dims and tk keys (None: long maps) (cached).
    fp16/bf16 up to D = 128: the fastest config per kernel of the H200 sweep (`python -m lit_thresh.bench
    --sweep`, T = 4096, B = 4, H = 16; ms below, `was` = the previous default; see lit_thresh/ops/PERF.md;
    the bf16 D = 128 dK/dV tile from an A/B on an H100, PERF.md v17), with TMA loads where they won by >= 3%
    (each TMA launch costs host time for its descriptors, so eager calls of less work than TMA_MIN_WORK load
    through pointers instead), and smaller tiles for short maps (SHORT_KEYS, PERF.md v21); skip_zero off (it
    pays only on maps with most tiles all zero). fp32 and D > 128: small-tile starting points, not tuned.
    Small tiles under the interpreter."""
    return _default_configs(head_dim, dtype, triton_interpreting(), 2 if tk is None else length_class(tk))


def skip_zero_configs(head_dim: int, dtype: torch.dtype) -> KernelConfigs:
    """default_configs with skip_zero on in the three kernels (cached)."""
    return _skip_zero_configs(head_dim, dtype, triton_interpreting())


@functools.lru_cache(maxsize=64)
def _skip_zero_configs(head_dim: int, dtype: torch.dtype, interpreting: bool) -> KernelConfigs:
    cfgs = _default_configs(head_dim, dtype, interpreting)  # the long maps' tiles at any length: map_shape's grain
    return KernelConfigs(*(replace(cfg, skip_zero=True) for cfg in (cfgs.fwd, cfgs.bwd_dkv, cfgs.bwd_dq)))


@functools.lru_cache(maxsize=64)
def _default_configs(head_dim: int, dtype: torch.dtype, interpreting: bool, length: int = 2) -> KernelConfigs:
    if interpreting:
        return KernelConfigs(BlockConfig(32, 32), BlockConfig(32, 32), BlockConfig(32, 32))
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfigs(BlockConfig(64, 32, 4, 2), BlockConfig(32, 64, 4, 2), BlockConfig(64, 32, 4, 2))
    long = _long_configs(head_dim, dtype)
    if head_dim > 64:  # fp16 and bf16: PERF.md v21 (length_class)
        fwd = BlockConfig(64, 64, 4, 3, tma=True) if length <= 1 else long.fwd
        dkv = BlockConfig(32, 64, 4, 3, tma=True) if length == 0 else long.bwd_dkv
        return replace(long, fwd=fwd, bwd_dkv=dkv)
    if dtype == torch.float16 and length == 0:
        return replace(long, bwd_dkv=BlockConfig(32, 64, 4, 3, tma=True))
    return long


def _long_configs(head_dim: int, dtype: torch.dtype) -> KernelConfigs:
    """default_configs' fp16 and bf16 tiles for D <= 128 on maps past SHORT_KEYS."""
    small = BlockConfig(64, 64, 4, 3)
    if dtype == torch.bfloat16 and head_dim > 64:
        return KernelConfigs(
            BlockConfig(128, 64, 8, 3, tma=True),  # fwd 0.490 ms (was 0.529)
            BlockConfig(64, 128, 8, 3, tma=True),  # PERF.md v17, H100: backward 0.91-0.97x 32x64 w4 s3's at T >= 2048
            BlockConfig(128, 64, 8, 4, tma=True),  # backward 1.98 ms with the new dkv (128x64 w8 s3: 2.07)
        )
    if dtype == torch.bfloat16:  # fwd 0.285, dq 1.306 as before; dkv re-swept in PERF.md v16 (backward 0.897 ms, was 0.963)
        return KernelConfigs(small, BlockConfig(32, 64, 4, 3, tma=True), small)
    if head_dim > 64:  # float16, re-swept in PERF.md v7: fwd 0.594 ms (was 0.612); dK/dV and dQ kept
        return KernelConfigs(
            BlockConfig(128, 64, 8, 3, tma=True),
            BlockConfig(64, 128, 8, 3, tma=True),
            BlockConfig(128, 64, 8, 3, tma=True),
        )
    return KernelConfigs(  # float16, D <= 64, re-swept in PERF.md v7 (fwd 0.356 ms, was 0.371); dkv in v16
        BlockConfig(64, 64, 4, 3, tma=True), BlockConfig(64, 64, 4, 4, tma=True), small)  # (backward 1.083, was 1.136)


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


def _single_metas(d: int, dv: int, power: float, dtype: torch.dtype, precision: str, interpreting: bool):
    """The constexprs of the forward kernel and of the two backward kernels (read-only). fp16 scales P and
    dS rows by fixed powers of two (ROW_SCALE), except dS for p < 1, which has no bound: the backward
    then scales per tile (FP16_RANGE)."""
    common = dict(
        D=d,
        DV=dv,
        BLOCK_D=_block_dim(d),
        BLOCK_DV=_block_dim(dv),
        POWER_MODE=_power_mode(power),
        PRECISION=precision,
        UPCAST=dtype == torch.bfloat16 and interpreting,
    )
    fp16 = dtype == torch.float16
    fwd = dict(common, ROW_SCALE=fp16)
    bwd = dict(common, ROW_SCALE=fp16 and power >= 1.0, FP16_RANGE=fp16 and power < 1.0)
    return MappingProxyType(fwd), MappingProxyType(bwd)


TMA_MIN_WORK = 1 << 35
"""Eager calls with less work than this, B * Hq * Tq * Tk * max(D, Dv), load the default tiles through pointers
rather than TMA descriptors: a TMA launch (Triton encodes a descriptor per input at each) cost the host more
than TMA saves on the GPU in calls this small. Measured on an H200, eager calls, bf16 and fp16, D = 64 and
128 (lit_thresh/ops/PERF.md, v14): on tiny inputs TMA made the forward 21-40 us and the forward+backward 50-272 us
slower; at 2^34 (D = 64, 2^28 scores) pointers took 0.80-0.88x TMA's forward+backward time; from 2^35 TMA was
faster (D = 128 at 2^28 scores: 0.86-0.97x pointers' time; D = 64 at 2^30: 0.91-0.93x). A call being captured
into a CUDA graph (compile: reduce-overhead) pays that host time once: it keeps TMA at any size."""


@functools.lru_cache(maxsize=256)
def _plan(d: int, dv: int, dtype: torch.dtype, power: float, precision: str, interpreting: bool,
          configs: KernelConfigs | None, skip_zero: bool = False, tma: bool = True, length: int = 2) -> tuple:
    """What every launch with these head dims, dtype and power shares, cached so that a call does no
    more Python than it must: per kernel (fwd, bwd_dkv, bwd_dq), its config and keyword arguments
    (constexprs and launch options; shared between calls: read, never written). Keyed on the key length's
    class only (length_class), not on the sequence lengths, which change at every step of decoding. configs
    None: the default tiles of that length class, skip_zero's (any length) where skip_zero is true, with TMA
    loads only where tma is true."""
    if configs is None:
        if skip_zero:
            configs = _skip_zero_configs(max(d, dv), dtype, interpreting)
        else:
            configs = _default_configs(max(d, dv), dtype, interpreting, length)
        if not tma:
            kernels = (configs.fwd, configs.bwd_dkv, configs.bwd_dq)
            configs = KernelConfigs(*(replace(cfg, tma=False) for cfg in kernels))
    fwd_meta, bwd_meta = _single_metas(d, dv, power, dtype, precision, interpreting)
    return tuple((cfg, dict(meta, **_launch_meta(cfg)))  # a dict: `**` reads it faster than a mapping proxy
                 for cfg, meta in zip((configs.fwd, configs.bwd_dkv, configs.bwd_dq), (fwd_meta, bwd_meta, bwd_meta)))


def call_work(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """A call's size as the default tiles' rules weigh it: B * Hq * Tq * Tk * max(D, Dv)."""
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * max(q.shape[3], v.shape[3])


def default_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the default tiles load through TMA descriptors in this call (TMA_MIN_WORK)."""
    return call_work(q, k, v) >= TMA_MIN_WORK or (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _problem_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, power: float, configs: KernelConfigs | None,
                  skip_zero: bool = False) -> tuple:
    """_plan for these inputs (configs None: the default tiles for this call, skip_zero's where
    skip_zero): one cache lookup per launcher call."""
    defaults = configs is None  # explicit configs carry their own tiles, skip_zero and TMA choices
    length = length_class(k.shape[2]) if defaults and not skip_zero else 2  # skip_zero's tiles: any length
    return _plan(q.shape[3], v.shape[3], q.dtype, power, _precision(q.dtype), triton_interpreting(), configs,
                 skip_zero and defaults, not defaults or default_tma(q, k, v), length)


_GAIN_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}
_RETIRED_GAIN_TABLES: list[torch.Tensor] = []  # tables outgrown: kept, as a CUDA graph captured before may read them


def _make_gain_table(size: int, d: int, device: torch.device) -> torch.Tensor:
    return torch.arange(size, device=device, dtype=torch.float64).log1p_().mul_(2.0 / d).sqrt_().float()  # (size,)


def _made_on_another_thread(size: int, d: int, device: torch.device) -> torch.Tensor:
    """_make_gain_table on a helper thread, finished before it returns. torch.compile's CUDA-graph warm-up
    routes every allocation of the calling thread (on any stream) into its graphs' private pool, whose state
    it may later reset under a live tensor; another thread's allocations stay in the default pool."""
    def make() -> torch.Tensor:
        with torch.cuda.device(device):
            table = _make_gain_table(size, d, device)
            torch.cuda.current_stream(device).synchronize()  # ready before any stream of any thread reads it
            return table

    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(make).result()


def gain_table(device: torch.device, d: int, n: int) -> torch.Tensor:
    """sqrt(2 ln(pos + 1) / d) for every position pos < n at least, fp32 on `device` (the kernels' GAINS):
    tau_i = beta * table[pos_i], one table for every kernel of a call, so they all see the same tau. Made in
    float64 and cached per (device, d), at the next power of 2 of n; an outgrown table is kept alive, since a
    CUDA graph captured before may read it. A cached CUDA table is made on a helper thread
    (_made_on_another_thread), outside any CUDA graph's memory pool. While a CUDA graph is being captured, a
    table not cached, or cached but too short, is made by the graph and not kept (its values exist only
    once the graph runs)."""
    old = _GAIN_TABLES.get((device, d))
    if old is not None and old.numel() >= n:
        return old
    size = 1 << (max(n, 2) - 1).bit_length()
    if device.type != "cuda":
        table = _make_gain_table(size, d, device)
    elif torch.cuda.is_current_stream_capturing():
        return _make_gain_table(size, d, device)
    else:
        table = _made_on_another_thread(size, d, device)
    if old is not None:
        _RETIRED_GAIN_TABLES.append(old)
    _GAIN_TABLES[(device, d)] = table
    return table


@functools.lru_cache(maxsize=64)
def _norms_meta(d: int) -> dict:
    """row_norms_kernel's constexprs for rows of d elements (~8k elements a program)."""
    block_d = _block_dim(d)
    return dict(D=d, BLOCK_D=block_d, BLOCK_T=max(16, 8192 // block_d))


def stacked_row_norms(*tensors: torch.Tensor) -> torch.Tensor:
    """The Euclidean norms of the rows of (B, H, T, D') tensors that share (B, H, T), in fp32, stacked:
    (B, H, len(tensors), T), contiguous. One row_norms_kernel launch each, instead of torch's
    vector_norm (PERF.md v9). Sums in fp32, also for fp64 inputs (inf past |x| ~ 1.8e19)."""
    b, h, t = tensors[0].shape[:3]
    out = torch.empty(b, h, len(tensors), t, device=tensors[0].device, dtype=torch.float32)
    for i, x in enumerate(tensors):
        meta, dst = _norms_meta(x.shape[3]), out[:, :, i]  # dst: (B, H, T)
        if dst.numel():
            _NORMS((-(-t // meta["BLOCK_T"]), b * h), (x, dst), (h, t, *x.stride(), *dst.stride()), meta)
    return out


def _tma_ready(*tensors: torch.Tensor, cols: int = 0) -> bool:
    """Whether every (B, H, T, D) tensor meets the TMA layout rules (unit last stride, 16-byte aligned base
    and strides) and tile rows of `cols` elements span at most 256 bytes (the widest run on the H200)."""
    for t in tensors:
        size = t.element_size()
        sb, sh, st, sd = t.stride()  # any of the four low bits set below: some value not 16-byte aligned
        if sd != 1 or cols * size > 256 or (t.data_ptr() | sb * size | sh * size | st * size) % 16:
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


def _margin(q: torch.Tensor, k: torch.Tensor, scale: float, k_norms: torch.Tensor | None = None) -> torch.Tensor:
    """The skip_zero map's margin, (1,) float32 on the device (no host sync): 1e-2 |scale| max|q| max|k|
    over the whole call, above the difference between two kernels' products of the same rows and keys
    (summation order; tf32's operand rounding, up to ~2e-3 relative, included). NaN where q or k holds an
    inf or NaN (or the bound overflows), which keeps every tile: with an inf in q, a tile whose scores are
    all -inf has weights 0 but gradients 0 * inf = NaN. k_norms: k's fp32 row norms (stacked_row_norms) where
    the caller has them already (the fp16 forward), not computed again."""
    k_norms = stacked_row_norms(k) if k_norms is None else k_norms
    margin = stacked_row_norms(q).amax() * k_norms.amax() * (1e-2 * abs(scale))
    return (margin + margin * 0.0).reshape(1)  # inf * 0 = NaN: a bound past fp32's range becomes NaN


def _map_shape(q: torch.Tensor, k: torch.Tensor, grain: tuple[int, int]) -> tuple[int, int, int]:
    """The skip_zero map's shape at grain (block_m, block_n): (B * Hq, cdiv(Tq, block_m), cdiv(Tk, block_n))."""
    return q.shape[0] * q.shape[1], -(-q.shape[2] // grain[0]), -(-k.shape[2] // grain[1])


def _new_map(q: torch.Tensor, k: torch.Tensor, grain: tuple[int, int]) -> torch.Tensor:
    """A zeroed int8 skip_zero map at grain (block_m, block_n)."""
    return torch.zeros(_map_shape(q, k, grain), device=q.device, dtype=torch.int8)


def map_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """The shape of the map triton_forward writes with skip_zero and the default tiles."""
    cfg = skip_zero_configs(int(max(q.shape[3], v.shape[3])), q.dtype).fwd  # int: a symbolic head dim is guarded
    return _map_shape(q, k, (cfg.block_m, cfg.block_n))


def live_tiles(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, scale: float, grain: tuple[int, int],
               kw: dict) -> torch.Tensor:
    """The skip_zero tile map at (block_m, block_n) = grain, from a pre-pass (threshold_live_tiles_kernel;
    its QK^T is the whole cost), for a backward called without its forward's map (triton_backward called
    directly; the op always passes the forward's): (B * Hq, cdiv(Tq, block_m),
    cdiv(Tk, block_n)) int8, 1 where the causal (query tile, key tile) pair may hold a weight, 0 where
    every causal score of its real rows has x = scale q.k - tau <= -margin (_margin; a NaN or inf in q or
    k keeps every tile, a NaN beta its head's). kw: the constexprs of a kernel of this problem (D,
    BLOCK_D, PRECISION, UPCAST)."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    m, n = grain
    live = _new_map(q, k, grain)
    threshold_live_tiles_kernel[(live.shape[1], b * hq)](
        q, k, beta, gain_table(q.device, kw["D"], tk + m), _margin(q, k, scale), live, *q.stride(), *k.stride(),
        hq, hq // hkv, tq, tk, scale,
        D=kw["D"], BLOCK_D=kw["BLOCK_D"], BLOCK_M=m, BLOCK_N=n, PRECISION=kw["PRECISION"], UPCAST=kw["UPCAST"],
        num_warps=4 if m * n <= 64 * 64 else 8, num_stages=3,
    )
    return live


def _check_nesting(size: int, grain: int, names: str) -> None:
    """ValueError unless a kernel's tile size and the map's grain along one dimension nest (one divides the other)."""
    if max(size, grain) % min(size, grain):
        raise ValueError(f"skip_zero needs tile sizes that divide or are multiples of the map's, got {size} and {grain} "
                         f"({names})")


@functools.lru_cache(maxsize=64)
def _lists_meta(row_tile: int, row_grain: int, col_tile: int, col_grain: int, by_key: bool, block: int) -> dict:
    """tile_lists_kernel's constexprs, BLOCK_L = block (cached: FastLaunch keys them by identity)."""
    return dict(ROW_TILE=row_tile, ROW_GRAIN=row_grain, COL_TILE=col_tile, COL_GRAIN=col_grain, BY_KEY=by_key,
                BLOCK_L=block, num_warps=4 if block <= 256 else 8)


def tile_lists(live: torch.Tensor, grain: tuple[int, int], cfg: BlockConfig, tq: int, tk: int,
               by_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's skip_zero work lists from the tile map `live` ((B * Hq, cdiv(tq, grain[0]), cdiv(tk,
    grain[1])) int8, any strides; grain's sizes divide or are multiples of the kernel's block sizes): for each
    row of its grid, the ascending indices of the tiles of its unmasked loop (the masked diagonal tiles always
    run) that may hold a weight, and their count. by_key (the dK/dV kernel): a row per (batch, query head, key
    tile) listing query tiles; else a row per (batch, query head, query tile) listing key tiles. One
    tile_lists_kernel launch (PERF.md v10). Returns (lists (rows, row length) int32, 0 after each row's count;
    counts (rows,) int32)."""
    bm, bn = cfg.block_m, cfg.block_n
    _check_nesting(bm, grain[0], "block_m and the map's query grain")
    _check_nesting(bn, grain[1], "block_n and the map's key grain")
    tiles_m, tiles_n = -(-tq // grain[0]), -(-tk // grain[1])  # the map's shape past B * Hq
    if live.dim() != 3 or live.shape[1:] != (tiles_m, tiles_n) or live.dtype != torch.int8:
        raise ValueError(f"live must be an int8 map of shape (B * Hq, {tiles_m}, {tiles_n}) for "
                         f"tq = {tq}, tk = {tk} at grain {grain}, got {live.dtype} {tuple(live.shape)}")
    n_m, n_n = -(-tq // bm), -(-tk // bn)
    heads = live.shape[0]
    if by_key:  # rows: key tiles; lists: query tiles (the map read transposed)
        rows, length, strides, dims = n_n, n_m, (live.stride(0), live.stride(2), live.stride(1)), (tiles_n, tiles_m)
        tiles = (bn, grain[1], bm, grain[0])
    else:
        rows, length, strides, dims = n_m, n_n, live.stride(), (tiles_m, tiles_n)
        tiles = (bm, grain[0], bn, grain[1])
    lists = torch.empty(heads * rows, length, device=live.device, dtype=torch.int32)  # (B * Hq * rows, length)
    counts = torch.empty(heads * rows, device=live.device, dtype=torch.int32)  # (B * Hq * rows,)
    if lists.numel():
        block = min(1024, max(16, 1 << (length - 1).bit_length()))  # the next power of 2, in plain ints
        _LISTS((rows, heads), (live, lists, counts), (*strides, *dims, rows, length, tq, tk),
               _lists_meta(*tiles, by_key, block))
    return lists, counts


def _forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, power: float, scale: float,
                    configs: KernelConfigs | None, skip_zero: bool) -> tuple:
    """What triton_forward launches, (grid, tensors, scalars, constexprs, use_tma), and its outputs (out, map)."""
    (cfg, kw), _, _ = _problem_plan(q, k, v, power, configs, skip_zero)
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    grid = (-(-tq // cfg.block_m), b * hq)  # ceil-divisions in plain ints: triton.cdiv costs host time
    out = _empty_like_layout(q, (b, hq, tq, dv))
    bd, bdv = kw["BLOCK_D"], kw["BLOCK_DV"]
    srcs, use_tma = _sources(cfg, (q, k, v), (cfg.block_m, cfg.block_n, cfg.block_n), (bd, bd, bdv))
    k_norms = stacked_row_norms(k) if kw["ROW_SCALE"] else beta  # (B, Hkv, 1, Tk); beta: unused
    margin = live = None
    if cfg.skip_zero:
        margin = _margin(q, k, scale, k_norms if kw["ROW_SCALE"] else None)
        live = _new_map(q, k, (cfg.block_m, cfg.block_n))
    tensors = (*srcs, out, beta, gain_table(q.device, d, tk + cfg.block_m), k_norms,
               beta if margin is None else margin, beta if live is None else live)
    scalars = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), hq, hq // hkv, tq, tk, scale, power)
    return grid, tensors, scalars, kw, use_tma, out, live


def triton_forward(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,) float32
    power: float,
    scale: float,
    configs: KernelConfigs | None = None,
    skip_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward pass: (out (B, Hq, Tq, Dv) in q's dtype, map). configs: the kernels' tiles (None: the
    defaults, with skip_zero on where skip_zero is true). With skip_zero in the forward's config, every
    tile still runs and map is the skip_zero tile map at the forward's tiles, for triton_backward's
    `live`; else map is None."""
    grid, tensors, scalars, kw, use_tma, out, live = _forward_launch(q, k, v, beta, power, scale, configs, skip_zero)
    _FWD(grid, tensors, scalars, kw, USE_TMA=use_tma)
    return out, live


@dataclass(frozen=True, slots=True)
class PreparedForward:
    """triton_forward's launch for one call signature (prepare_forward), made again for new tensors of that
    signature without the launcher's Python: the output, the gain table, then the kept compiled kernel."""

    compiled: object  # triton's CompiledKernel
    grid: tuple[int, int, int]
    device: int  # the CUDA device index launched on
    out_shape: tuple[int, int, int, int]  # (B, Hq, Tq, Dv)
    gains: torch.Tensor  # gain_table's table at preparation: long enough, and never freed (an outgrown one is retired)
    args: tuple  # the scalars and the constexprs after the tensors

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """triton_forward(q, k, v, beta, power, scale)[0] for inputs of the prepared signature."""
        out = _empty_like_layout(q, self.out_shape)
        launch(self.compiled, self.grid, self.device,
               (q, k, v, out, beta, self.gains, beta, beta, beta, *self.args))  # as _forward_launch's
        return out


def _on_current_cuda_device(q: torch.Tensor) -> bool:
    """Whether q is a CUDA tensor on the current device (where FastLaunch launches)."""
    return q.is_cuda and q.device.index == torch.cuda.current_device()


def prepare_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, power: float,
                    scale: float) -> PreparedForward | None:
    """triton_forward(q, k, v, beta, power, scale) with the default tiles, prepared for later calls whose
    inputs have these shapes, strides, dtypes, alignments and device, and the same power, scale and global
    state (matmul precision, CUDA-graph capture); the caller keys it on them. None where that launch loads
    through TMA descriptors, scales rows (fp16), has not run through FastLaunch yet, or is not on the
    current device: those calls take triton_forward."""
    if not _on_current_cuda_device(q):
        return None
    (_, kw), _, _ = _problem_plan(q, k, v, power, None)
    if kw["ROW_SCALE"]:  # its row-norm pre-pass would launch here
        return None
    grid, tensors, scalars, kw, use_tma, out, _ = _forward_launch(q, k, v, beta, power, scale, None, False)
    # tensors: (q, k, v, out, beta, gains, ...)
    kept = None if use_tma else _FWD.kept(tensors, scalars, kw, USE_TMA=False)
    if kept is None:
        return None
    return PreparedForward(kept[0], (*grid, 1), torch.cuda.current_device(), tuple(out.shape), tensors[5],
                           (*scalars, *kept[1]))


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
    skip_zero: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward pass: (dq, dk, dv, dbeta); dbeta (Hq,) is reduced deterministically from per-row terms.
    configs, skip_zero: as triton_forward. live: the map triton_forward returned with these configs, for
    the kernels that skip (None: a pre-pass makes one)."""
    (fwd_cfg, _), (dkv_cfg, dkv_kw), (dq_cfg, dq_kw) = _problem_plan(q, k, v, power, configs, skip_zero)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    scalars = (tq, tk, scale, power)
    gains = gain_table(q.device, d, tk + max(dkv_cfg.block_m, dq_cfg.block_m))  # (>= Tk + BLOCK_M,)
    dq, dk, dval = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq_kw["ROW_SCALE"]:  # the norms the fp16 row scales are bounded by; else unused (beta is passed)
        qdo_norms = stacked_row_norms(q, dout)  # (B, Hq, 2, Tq)
        kv_norms = stacked_row_norms(k, v)  # (B, Hkv, 2, Tk)
    else:
        qdo_norms = kv_norms = beta
    inputs = (q, k, v, dout)
    bd, bdv = dq_kw["BLOCK_D"], dq_kw["BLOCK_DV"]

    dkv_lists = dkv_counts = dq_lists = dq_counts = beta  # unused unless skip_zero
    skipping = [cfg for cfg in (dkv_cfg, dq_cfg) if cfg.skip_zero]
    if skipping and live is not None:  # the forward's map
        grain = (fwd_cfg.block_m, fwd_cfg.block_n)
        if live.shape != (want := _map_shape(q, k, grain)) or live.dtype != torch.int8:
            raise ValueError(f"live must be the forward's int8 map of shape {want}, got {live.dtype} {tuple(live.shape)}")
    elif skipping:  # one map at the finest tiles of the two kernels
        grain = (min(cfg.block_m for cfg in skipping), min(cfg.block_n for cfg in skipping))
        live = live_tiles(q, k, beta, scale, grain, dq_kw)
    if dkv_cfg.skip_zero:
        dkv_lists, dkv_counts = tile_lists(live, grain, dkv_cfg, tq, tk, by_key=True)
    if dq_cfg.skip_zero:
        dq_lists, dq_counts = tile_lists(live, grain, dq_cfg, tq, tk, by_key=False)
    m, n = dkv_cfg.block_m, dkv_cfg.block_n
    srcs, use_tma = _sources(dkv_cfg, inputs, (m, n, n, m), (bd, bd, bdv, bdv))
    _BWD_DKV(
        (-(-tk // n), b * hkv), (*srcs, dk, dval, beta, gains, qdo_norms, dkv_lists, dkv_counts),
        (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dval.stride(), hkv, hq // hkv, *scalars),
        dkv_kw, USE_TMA=use_tma,
    )

    dbeta_rows = torch.empty(b * hq, tq, device=q.device, dtype=torch.float32) if need_dbeta else dq
    m, n = dq_cfg.block_m, dq_cfg.block_n
    srcs, use_tma = _sources(dq_cfg, inputs, (m, n, n, m), (bd, bd, bdv, bdv))
    _BWD_DQ(
        (-(-tq // m), b * hq), (*srcs, dq, dbeta_rows, beta, gains, kv_norms, dq_lists, dq_counts),
        (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(), hq, hq // hkv, *scalars),
        dq_kw, BETA_GRAD=need_dbeta, USE_TMA=use_tma,
    )
    dbeta = dbeta_rows.view(b, hq, tq).sum(dim=(0, 2)) if need_dbeta else None  # float32, as beta
    return dq, dk, dval, dbeta
