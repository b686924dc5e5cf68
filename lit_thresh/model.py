"""Decoder-only Transformer in the nanoGPT layout, with a pluggable attention variant.

token embedding (+ learned positions) -> n_layers pre-norm blocks -> norm -> LM head (tied).
Positions: learned absolute embeddings, RoPE inside attention, or none (causal masking alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from lit_thresh.attention import Attention, AttentionFactory, KVCache, RotaryEmbedding, SoftmaxAttention
from lit_thresh.validation import check_finite_float, check_int

Positional = Literal["rope", "learned", "none"]
Norm = Literal["rmsnorm", "layernorm"]


def make_norm(kind: Norm, d_model: int) -> nn.Module:
    """RMSNorm, or LayerNorm without bias (nanoGPT's `bias=False`)."""
    return nn.RMSNorm(d_model) if kind == "rmsnorm" else nn.LayerNorm(d_model, bias=False)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.act = nn.GELU()
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) if it has an MLP."""

    def __init__(self, d_model: int, attn: Attention, mlp_hidden: int, dropout: float, norm: Norm = "rmsnorm") -> None:
        super().__init__()
        self.attn_norm = make_norm(norm, d_model)
        self.attn = attn
        self.mlp_norm = make_norm(norm, d_model) if mlp_hidden else None
        self.mlp = MLP(d_model, mlp_hidden) if mlp_hidden else None
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, cache))  # (B, T, C)
        if self.mlp is not None:
            x = x + self.dropout(self.mlp(self.mlp_norm(x)))  # (B, T, C)
        return x

    def residual_projections(self) -> list[nn.Linear]:
        """The layers that write into the residual stream (scaled at init, as in GPT-2)."""
        return [self.attn.out_proj] + ([self.mlp.down_proj] if self.mlp is not None else [])


@dataclass
class TransformerConfig:
    """The Transformer's architecture (YAML: `model.config.<field>`); checked when built.

    vocab_size, max_seq_len: linked from the data by the CLI; attention: builds each layer's attention
    as `attention(d_model, n_heads, layer_index, n_kv_heads=n_kv_heads, key_conv=key_conv)` (YAML:
    `attention: {class_path: ..., init_args: {...}}`); positional: 'rope', 'learned' (max_seq_len
    positions) or 'none'; mlp_ratio: MLP hidden width / d_model, 0 = attention-only blocks (as Zoology's
    MQAR models); dropout: on the embeddings and on each residual branch; key_conv: width of a depthwise
    causal convolution over time on every attention layer's keys (attention.base.KeyConv), 0 = none;
    norm: 'rmsnorm' or 'layernorm' (bias-free, as nanoGPT) before each branch and the LM head.
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 1
    n_kv_heads: int | None = None
    attention: AttentionFactory = SoftmaxAttention
    positional: Positional = "rope"
    max_seq_len: int = 1024
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    key_conv: int = 0
    norm: Norm = "rmsnorm"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
            check_int(name, getattr(self, name))
        if self.norm not in get_args(Norm):
            raise ValueError(f"norm must be one of {get_args(Norm)}, got {self.norm!r}")
        if self.positional not in get_args(Positional):
            raise ValueError(f"positional must be one of {get_args(Positional)}, got {self.positional!r}")
        check_finite_float("mlp_ratio", self.mlp_ratio)
        if self.mlp_ratio < 0:
            raise ValueError(f"mlp_ratio must be >= 0 (0 = no MLP), got {self.mlp_ratio}")
        check_finite_float("dropout", self.dropout)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class Transformer(nn.Module):
    """Decoder-only language model: token ids (B, T) -> next-token logits (B, T, vocab_size), built from
    a TransformerConfig."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.max_seq_len = config.max_seq_len
        self.token_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.positional == "learned" else None
        self.rope = RotaryEmbedding() if config.positional == "rope" else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList()
        for i in range(config.n_layers):
            attn = config.attention(
                config.d_model, config.n_heads, i, n_kv_heads=config.n_kv_heads, key_conv=config.key_conv
            )
            if not isinstance(attn, Attention):
                raise TypeError(f"attention must build a lit_thresh.attention.Attention, got {type(attn).__name__}")
            if self.rope is not None and attn.qk_head_dim % 2:
                raise ValueError(f"positional='rope' needs an even q/k head dim, got {attn.qk_head_dim}")
            mlp_hidden = round(config.mlp_ratio * config.d_model)
            self.blocks.append(Block(config.d_model, attn, mlp_hidden, config.dropout, config.norm))
        self.norm = make_norm(config.norm, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_emb.weight  # weight tying

        # GPT-2 init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(number of residual branches)).
        self.apply(self._init_weights)
        projections = [proj for block in self.blocks for proj in block.residual_projections()]
        for proj in projections:
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(len(projections)))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def new_caches(self) -> list[KVCache]:
        """Empty KV caches, one per layer, for incremental decoding with `forward`."""
        return [KVCache() for _ in self.blocks]

    def forward(self, idx: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V). With caches (from `new_caches`), idx holds the T tokens
        after the cached ones, and the caches are extended by them."""
        t = idx.shape[1]
        start = 0 if caches is None else caches[0].length
        x = self.token_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            if start + t > self.max_seq_len:
                raise ValueError(f"sequence length {start + t} exceeds max_seq_len ({self.max_seq_len})")
            x = x + self.pos_emb(torch.arange(start, start + t, device=idx.device))  # (B, T, C)
        x = self.dropout(x)
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks), strict=True):
            x = block(x, self.rope, cache)  # (B, T, C)
        return self.lm_head(self.norm(x))  # (B, T, V)

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Appends max_new_tokens sampled tokens to the prompts idx (B, T), decoding with a KV cache.

        temperature 0 = greedy; top_k: sample among the k most likely tokens only. Call `.eval()`
        first to turn dropout off. With learned positions, once the sequence outgrows max_seq_len each
        step re-reads the last max_seq_len tokens (as nanoGPT). Returns (B, T + max_new_tokens).
        """
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k is not None:
            check_int("top_k", top_k)
        caches = self.new_caches()
        tokens = idx  # the prompts first, then one new token per step
        for _ in range(max_new_tokens):
            if self.pos_emb is not None and caches[0].length + tokens.shape[1] > self.max_seq_len:
                caches, tokens = self.new_caches(), idx[:, -self.max_seq_len :]  # slide the window
            logits = self(tokens, caches)[:, -1]  # (B, V)
            tokens = sample(logits, temperature, top_k)  # (B, 1)
            idx = torch.cat([idx, tokens], dim=1)
        return idx


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """Next tokens (B, 1) from logits (B, V): argmax at temperature 0, else softmax(logits / T) (top-k)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1)
