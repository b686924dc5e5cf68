"""What every attention variant shares: projections, heads, grouped-query attention, RoPE, KV cache.

A variant subclasses `Attention` and implements `attend` (plus its own parameters):

    q (B, G*H, Tq, Dq), k (B, G*Hkv, Tk, Dq), v (B, Hkv, Tk, Dh)  ->  (B, H, Tq, Dh)

and `attention_weights(q, k) -> (B, H, Tq, Tk)`, the same map in plain PyTorch (for diagnostics only).

H query heads, Hkv key/value heads (GQA when Hkv < H), Dh = d_model / H, G = `qk_groups` (q, k)
pairs per head sharing one v (2 for differential attention) and Dq = Dh / G. The queries are the
last Tq of the Tk positions (Tq < Tk when decoding with a KV cache); attention is always causal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from lit_thresh.validation import check_finite_float, check_int


def causal_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i (position Tk - Tq + i) may see key j (j <= Tk - Tq + i)."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


@dataclass
class KVCache:
    """Keys and values of the positions seen so far by one attention layer (incremental decoding)."""

    k: torch.Tensor | None = None  # (B, G*Hkv, T, Dq), after RoPE
    v: torch.Tensor | None = None  # (B, Hkv, T, Dh)
    k_tail: torch.Tensor | None = None  # (B, width - 1, C): the last k_proj outputs, for the key conv

    @property
    def length(self) -> int:
        """Number of cached positions: the position of the next token."""
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new positions' k and v; returns the keys and values of all positions."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), rotate-half layout, applied to q and k of any even head dim."""

    def __init__(self, theta: float = 10000.0) -> None:
        super().__init__()
        check_finite_float("theta", theta, positive=True)
        self.theta = theta

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotates x (B, H, T, D) as the positions start, ..., start + T - 1."""
        t, d = x.shape[-2:]
        dtype = torch.promote_types(x.dtype, torch.float32)
        inv_freq = self.theta ** -(torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)  # (D/2,)
        angles = torch.arange(start, start + t, device=x.device, dtype=dtype)[:, None] * inv_freq  # (T, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (T, D/2)
        x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, H, T, D)

    def extra_repr(self) -> str:
        return f"theta={self.theta}"


class KeyConv(nn.Module):
    """Depthwise causal convolution over time of width `width`, applied to the keys (k_proj's output,
    before RoPE): k'_t = sum_{s < width} w_s * k_{t-s} per channel, zeros before the first position.

    A key then carries its predecessors' tokens, so one attention layer can match a query against
    the token *before* each value (associative recall) without a previous-token head in an earlier
    layer (the short convolution of H3 / Based, the "smeared keys" of Olsson et al. 2022). Initialised
    as the uniform average of the `width` positions.
    """

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        check_int("channels", channels)
        check_int("width", width, minimum=2)
        self.width = width
        self.weight = nn.Parameter(torch.full((channels, width), 1.0 / width))  # (C, W), tap W-1 = current

    def forward(self, k: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """k (B, T, C) -> (B, T, C); with a cache, k follows the cached positions, whose tail it extends."""
        b, _, c = k.shape
        prev = None if cache is None else cache.k_tail
        if prev is None:
            prev = k.new_zeros(b, self.width - 1, c)
        full = torch.cat([prev, k], dim=1)  # (B, W-1+T, C)
        if cache is not None:
            cache.k_tail = full[:, -(self.width - 1) :]
        out = nn.functional.conv1d(full.transpose(1, 2), self.weight.unsqueeze(1).to(k.dtype), groups=c)
        return out.transpose(1, 2)  # (B, T, C)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, width={self.width}"


class Attention(nn.Module, ABC):
    """Causal multi-head self-attention; subclasses implement `attend`. See the module docstring.

    d_model: model width; n_heads: query heads (d_model % n_heads == 0); layer_index: depth of the
    layer (0 = first), for variants whose initialisation depends on it; n_kv_heads: key/value heads
    (divides n_heads; default n_heads); key_conv: width of a causal convolution on the keys (KeyConv),
    0 = none. The projections have no bias. A variant passes n_kv_heads and key_conv on to this class.
    """

    qk_groups: ClassVar[int] = 1  # (q, k) pairs per head sharing one v
    max_head_dim: ClassVar[int | None] = None  # the largest head dim Dh `attend` takes; None = any

    def __init__(
        self, d_model: int, n_heads: int, layer_index: int = 0, *, n_kv_heads: int | None = None, key_conv: int = 0
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            check_int(name, value)
        check_int("layer_index", layer_index, minimum=0)
        check_int("key_conv", key_conv, minimum=0)
        if key_conv == 1:
            raise ValueError("key_conv must be 0 (none) or a width >= 2, got 1")
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        head_dim = d_model // n_heads
        if head_dim % self.qk_groups:
            raise ValueError(
                f"{type(self).__name__} splits each head into {self.qk_groups} (q, k) pairs: the head dim "
                f"d_model / n_heads ({head_dim}) must be divisible by {self.qk_groups}"
            )
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            raise ValueError(
                f"{type(self).__name__} takes head dims up to {self.max_head_dim}, got d_model / n_heads = "
                f"{d_model} / {n_heads} = {head_dim}: use more heads"
            )
        self.n_heads, self.n_kv_heads, self.layer_index = n_heads, n_kv_heads, layer_index
        self.head_dim = head_dim  # Dh, of v and of the output
        self.qk_head_dim = head_dim // self.qk_groups  # Dq, of q and k
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.key_conv = KeyConv(n_kv_heads * head_dim, key_conv) if key_conv else None
        self.record_weights = False  # when set, forward stores its attention map in `last_weights`
        self.last_weights: torch.Tensor | None = None  # (B, H, Tq, Tk)

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). rope: rotate q and k by position; cache: the earlier positions'
        k and v, which this call extends (x then holds the T positions after them)."""
        b, t, _ = x.shape
        g = self.qk_groups
        q = self.q_proj(x).view(b, t, g * self.n_heads, self.qk_head_dim).transpose(1, 2)  # (B, G*H, T, Dq)
        k = self.k_proj(x)  # (B, T, G*Hkv*Dq)
        if self.key_conv is not None:
            k = self.key_conv(k, cache)
        k = k.view(b, t, g * self.n_kv_heads, self.qk_head_dim).transpose(1, 2)  # (B, G*Hkv, T, Dq)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        if rope is not None:
            start = 0 if cache is None else cache.length
            q, k = rope(q, start), rope(k, start)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, G*Hkv, Tk, Dq), (B, Hkv, Tk, Dh)
        y = self.attend(q, k, v)  # (B, H, T, Dh)
        if self.record_weights:
            with torch.autocast(q.device.type, enabled=False):  # the map in float32 (or float64), as promised
                self.last_weights = self.attention_weights(q, k)  # (B, H, T, Tk)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, G*H, Tq, Dq), k (B, G*Hkv, Tk, Dq), v (B, Hkv, Tk, Dh) -> (B, H, Tq, Dh), causal,
        the queries being the last Tq positions."""

    @abstractmethod
    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The causal map `attend` applies to v, materialised in plain PyTorch (at least float32):
        q (B, G*H, Tq, Dq), k (B, G*Hkv, Tk, Dq) -> (B, H, Tq, Tk), zero on future keys. For
        diagnostics; the output normalisation `attend` may apply afterwards is not part of it."""

    def diagnostic_values(self) -> dict[str, torch.Tensor]:
        """Learned values to monitor, by name: (H,) per head or 0-d per layer (none by default)."""
        return {}

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"


class AttentionFactory(Protocol):
    """Builds one layer's attention: a variant class, or (from a config) the class with its kwargs bound.

    YAML: `attention: {class_path: lit_thresh.attention.ThresholdAttention, init_args: {beta: 1.0}}`.
    The Transformer gives the arguments below; a config sets the variant's own (init_args).
    """

    def __call__(
        self, d_model: int, n_heads: int, layer_index: int, *, n_kv_heads: int | None = None, key_conv: int = 0
    ) -> Attention: ...
