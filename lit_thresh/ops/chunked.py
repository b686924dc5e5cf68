"""Threshold attention in PyTorch, one block of queries at a time: the path for CPU tensors and float64.

Same math and the same saved state as the Triton kernels (only q, k, v, beta), but computed with
torch matmuls over query blocks, so memory stays O(T * block) instead of O(T^2) in both passes.
Accumulation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 128


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rectified_power(x: torch.Tensor, power: float) -> torch.Tensor:
    """ReLU(x)^p: exactly 0 where x <= 0, NaN where x is NaN (as ReLU(NaN) = NaN)."""
    dead = x <= 0  # False for NaN
    return torch.where(dead, 0.0, torch.where(dead, 1.0, x) ** power)


def _rectified_power_grad(x: torch.Tensor, power: float) -> torch.Tensor:
    """d/dx ReLU(x)^p = p * x^(p-1) for x > 0, 0 for x <= 0; for NaN x, NaN (p = 1: 1, as torch.relu)."""
    dead = x <= 0  # False for NaN
    return torch.where(dead, 0.0, power * torch.where(dead, 1.0, x) ** (power - 1.0))


class _Blocks:
    """Grouped views and per-row thresholds shared by the forward and backward loops."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float):
        acc = _accum_dtype(q.dtype)
        b, hq, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        self.tq, self.tk, self.scale = tq, tk, scale
        self.q = q.unflatten(1, (hkv, hq // hkv)).to(acc)  # (B, Hkv, G, Tq, D)
        self.k = k.unsqueeze(2).to(acc)  # (B, Hkv, 1, Tk, D)
        self.v = v.unsqueeze(2).to(acc)  # (B, Hkv, 1, Tk, Dv)
        self.pos = torch.arange(tk - tq, tk, device=q.device)  # (Tq,) absolute query positions
        self.gain = torch.sqrt(2.0 * torch.log1p(self.pos.to(acc)) / d)  # (Tq,) tau = beta * gain
        self.beta = beta.to(acc).view(hkv, hq // hkv, 1, 1)  # (Hkv, G, 1, 1)
        self.keys = torch.arange(tk, device=q.device)  # (Tk,)

    def ranges(self):
        for m0 in range(0, self.tq, QUERY_BLOCK):
            m1 = min(m0 + QUERY_BLOCK, self.tq)
            yield m0, m1, self.tk - self.tq + m1  # keys [0, hi) can be seen by queries [m0, m1)

    def shifted_scores(self, m0: int, m1: int, hi: int) -> torch.Tensor:
        """x = scale * q k^T - tau, set to 0 above the diagonal. (B, Hkv, G, m1-m0, hi)."""
        s = self.q[..., m0:m1, :] @ self.k[..., :hi, :].transpose(-1, -2)
        x = self.scale * s - self.beta * self.gain[m0:m1, None]
        causal = self.keys[None, :hi] <= self.pos[m0:m1, None]  # (m1-m0, hi)
        return x.masked_fill(~causal, 0.0)


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, power: float, scale: float
) -> torch.Tensor:
    """q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), beta (Hq,) -> (B, Hq, Tq, Dv)."""
    blk = _Blocks(q, k, v, beta, scale)
    out = q.new_empty(*blk.q.shape[:-1], v.shape[-1], dtype=blk.q.dtype)  # (B, Hkv, G, Tq, Dv)
    for m0, m1, hi in blk.ranges():
        p = _rectified_power(blk.shifted_scores(m0, m1, hi), power)  # (B, Hkv, G, c, hi)
        out[..., m0:m1, :] = p @ blk.v[..., :hi, :]
    return out.flatten(1, 2).to(q.dtype)


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    power: float,
    scale: float,
    dout: torch.Tensor,
    need_dbeta: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, dbeta) in the dtypes of (q, k, v, beta); dbeta is None unless asked."""
    blk = _Blocks(q, k, v, beta, scale)
    do = dout.unflatten(1, blk.q.shape[1:3]).to(blk.q.dtype)  # (B, Hkv, G, Tq, Dv)
    dq = torch.empty_like(q, dtype=blk.q.dtype)  # (B, Hq, Tq, D), laid out as q (as are dk and dv)
    dq_groups = dq.unflatten(1, blk.q.shape[1:3])  # (B, Hkv, G, Tq, D) view
    dk = torch.zeros_like(k, dtype=blk.q.dtype)  # (B, Hkv, Tk, D)
    dv = torch.zeros_like(v, dtype=blk.q.dtype)  # (B, Hkv, Tk, Dv)
    dbeta = torch.zeros_like(blk.beta[..., 0, 0])  # (Hkv, G)
    for m0, m1, hi in blk.ranges():
        x = blk.shifted_scores(m0, m1, hi)  # (B, Hkv, G, c, hi)
        do_c = do[..., m0:m1, :]  # (B, Hkv, G, c, Dv)
        ds = (do_c @ blk.v[..., :hi, :].transpose(-1, -2)) * _rectified_power_grad(x, power)
        dq_groups[..., m0:m1, :] = scale * (ds @ blk.k[..., :hi, :])
        dk[:, :, :hi] += scale * (ds.transpose(-1, -2) @ blk.q[..., m0:m1, :]).sum(2)
        dv[:, :, :hi] += (_rectified_power(x, power).transpose(-1, -2) @ do_c).sum(2)
        if need_dbeta:
            dbeta -= (ds.sum(-1) * blk.gain[m0:m1]).sum((0, 3))
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dbeta.flatten().to(beta.dtype) if need_dbeta else None,
    )
