"""Differential threshold attention in PyTorch, one block of queries at a time: the CPU / float64 path.

out = (ReLU(x1)^p - lambda_h ReLU(x2)^p) V with x_m = scale q_m k_m^T - tau (m = 1, 2; one beta, one V).
Same math and the same saved state as the fused Triton kernels (only the inputs); memory O(T * block).
Accumulation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from lit_thresh.ops.chunked import _Blocks, _rectified_power, _rectified_power_grad


class _PairBlocks:
    """The two maps' blocks (sharing v, beta and positions) and lambda as (Hkv, G, 1, 1)."""

    def __init__(
        self,
        q1: torch.Tensor,
        q2: torch.Tensor,
        k1: torch.Tensor,
        k2: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        lam: torch.Tensor,
        scale: float,
    ) -> None:
        self.one = _Blocks(q1, k1, v, beta, scale)
        self.two = _Blocks(q2, k2, v[..., :0], beta, scale)  # v is read from `one` only
        self.v = self.one.v  # (B, Hkv, 1, Tk, Dv)
        self.lam = lam.to(self.one.q.dtype).view_as(self.one.beta)  # (Hkv, G, 1, 1)

    def scores(self, m0: int, m1: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x1, x2: (B, Hkv, G, m1-m0, hi), 0 above the diagonal."""
        return self.one.shifted_scores(m0, m1, hi), self.two.shifted_scores(m0, m1, hi)


def chunked_differential_forward(
    q1: torch.Tensor,  # (B, Hq, Tq, D)
    q2: torch.Tensor,  # (B, Hq, Tq, D)
    k1: torch.Tensor,  # (B, Hkv, Tk, D)
    k2: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, Dv)
    beta: torch.Tensor,  # (Hq,)
    lam: torch.Tensor,  # (Hq,)
    power: float,
    scale: float,
) -> torch.Tensor:
    """Returns (B, Hq, Tq, Dv) in q1's dtype."""
    blk = _PairBlocks(q1, q2, k1, k2, v, beta, lam, scale)
    out = q1.new_empty(*blk.one.q.shape[:-1], v.shape[-1], dtype=blk.one.q.dtype)  # (B, Hkv, G, Tq, Dv)
    for m0, m1, hi in blk.one.ranges():
        x1, x2 = blk.scores(m0, m1, hi)  # (B, Hkv, G, c, hi) each
        p = _rectified_power(x1, power) - blk.lam * _rectified_power(x2, power)
        out[..., m0:m1, :] = p @ blk.v[..., :hi, :]
    return out.flatten(1, 2).to(q1.dtype)


def chunked_differential_backward(
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
) -> tuple[torch.Tensor, ...]:
    """(dq1, dq2, dk1, dk2, dv, dbeta, dlam) in the inputs' dtypes; dbeta / dlam are None unless asked."""
    blk = _PairBlocks(q1, q2, k1, k2, v, beta, lam, scale)
    one, two = blk.one, blk.two
    do = dout.unflatten(1, one.q.shape[1:3]).to(one.q.dtype)  # (B, Hkv, G, Tq, Dv)
    dq1, dq2 = torch.empty_like(one.q), torch.empty_like(two.q)  # (B, Hkv, G, Tq, D)
    dk1, dk2 = torch.zeros_like(one.k[:, :, 0]), torch.zeros_like(two.k[:, :, 0])  # (B, Hkv, Tk, D)
    dv = torch.zeros_like(blk.v[:, :, 0])  # (B, Hkv, Tk, Dv)
    dbeta = torch.zeros_like(one.beta[..., 0, 0])  # (Hkv, G)
    dlam = torch.zeros_like(dbeta)  # (Hkv, G)
    for m0, m1, hi in one.ranges():
        x1, x2 = blk.scores(m0, m1, hi)  # (B, Hkv, G, c, hi) each
        p2 = _rectified_power(x2, power)
        do_c = do[..., m0:m1, :]  # (B, Hkv, G, c, Dv)
        dp = do_c @ blk.v[..., :hi, :].transpose(-1, -2)  # (B, Hkv, G, c, hi)
        ds1 = dp * _rectified_power_grad(x1, power)
        ds2 = -blk.lam * dp * _rectified_power_grad(x2, power)
        dq1[..., m0:m1, :] = scale * (ds1 @ one.k[..., :hi, :])
        dq2[..., m0:m1, :] = scale * (ds2 @ two.k[..., :hi, :])
        dk1[:, :, :hi] += scale * (ds1.transpose(-1, -2) @ one.q[..., m0:m1, :]).sum(2)
        dk2[:, :, :hi] += scale * (ds2.transpose(-1, -2) @ two.q[..., m0:m1, :]).sum(2)
        p = _rectified_power(x1, power) - blk.lam * p2
        dv[:, :, :hi] += (p.transpose(-1, -2) @ do_c).sum(2)
        if need_dbeta:
            dbeta -= ((ds1 + ds2).sum(-1) * one.gain[m0:m1]).sum((0, 3))
        if need_dlam:
            dlam -= (dp * p2).sum((0, 3, 4))
    return (
        dq1.flatten(1, 2).to(q1.dtype),
        dq2.flatten(1, 2).to(q2.dtype),
        dk1.to(k1.dtype),
        dk2.to(k2.dtype),
        dv.to(v.dtype),
        dbeta.flatten().to(beta.dtype) if need_dbeta else None,
        dlam.flatten().to(lam.dtype) if need_dlam else None,
    )
