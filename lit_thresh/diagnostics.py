"""Attention diagnostics: statistics of the attention maps, and a callback that logs them to TensorBoard.

Per layer l and head h, measured on a small fixed validation batch (tags under ``diag/layer{l}/``):

- ``head{h}/zero_frac``: fraction of exact zeros among the causal weights (keys j <= query i): the
  sparsity of threshold attention; about 0 for softmax, whose weights are positive unless they underflow.
- ``head{h}/zero_tile_frac``: fraction of the 64 x 64 tiles wholly below the diagonal whose weights are all
  exact zeros: at most the share of the backward's off-diagonal work that ``skip_zero`` (docs/ops.md) skips
  at 64 x 64 tiles (a row with >= 7/8 of its tiles live runs them all; the kernels' tiles vary). Only for
  sequences of more than 64 positions; the zeros of a map can be many while its all-zero tiles are few.
- ``head{h}/sink_mass``: share of a query's total |weight| that falls on the first token, averaged over
  the queries at positions >= 1 that attend to something (position 0 sees only key 0 under every map,
  so it would add the same 1 to every variant; NaN when no query of the head attends anything).
- ``head{h}/keys_attended``: mean number of nonzero causal weights per query, and
  ``head{h}/keys_attended_pos{a}-{b}``: the same over the queries at positions a..b (equal bins, a
  and b zero-padded: ``pos00-15`` ... ``pos48-63`` for T = 64).
- ``head{h}/beta``, ``scale``, ``lambda``: the variant's ``Attention.diagnostic_values()`` (one per head, or one
  per layer for a 0-d value such as the Differential Transformer's lambda).
- ``attention`` (image): the first sequence's map, heads side by side, each query row scaled by its
  largest |weight|: positive weights gray to white, negative ones red, zeros black.

Differential variants are measured on their effective map A1 - lambda A2, the one that multiplies v:
its zeros are the keys both maps ignore, and the sink mass uses |weights| since the map may be negative.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lit_thresh.attention import Attention
from lit_thresh.attention.base import causal_mask
from lit_thresh.validation import check_int


def zero_fraction(weights: torch.Tensor) -> torch.Tensor:
    """Causal attention maps (B, H, Tq, Tk) -> (H,): fraction of exact zeros among the causal weights."""
    b, _, tq, tk = weights.shape
    causal = causal_mask(tq, tk, weights.device)  # (Tq, Tk)
    zeros = ((weights == 0) & causal).sum(dim=(0, 2, 3))  # (H,)
    return zeros.to(weights.dtype) / (b * causal.sum())


def zero_tile_fraction(weights: torch.Tensor, tile: int = 64) -> torch.Tensor | None:
    """Causal attention maps (B, H, Tq, Tk) -> (H,): fraction of the tile x tile tiles (from query 0 and key
    0) wholly below the diagonal (every query of the tile sees every key of it: the kernels' unmasked tiles)
    whose weights are all exact zeros; None when there is no such tile."""
    b, _, tq, tk = weights.shape
    n_m, n_n = -(-tq // tile), -(-tk // tile)
    first_pos = tk - tq + torch.arange(n_m, device=weights.device) * tile  # (n_m,) each query tile's first position
    last_key = torch.arange(1, n_n + 1, device=weights.device) * tile - 1  # (n_n,) each key tile's last key
    below = last_key[None, :] <= first_pos[:, None]  # (n_m, n_n)
    if not below.any():
        return None
    nonzero = F.pad((weights != 0).to(torch.uint8), (0, n_n * tile - tk, 0, n_m * tile - tq))  # (B, H, n_m*tile, n_n*tile)
    live = nonzero.unflatten(3, (n_n, tile)).unflatten(2, (n_m, tile)).amax(dim=(3, 5)) > 0  # (B, H, n_m, n_n)
    zero = (~live & below).sum(dim=(0, 2, 3))  # (H,)
    return zero.to(weights.dtype) / (b * below.sum())


def sink_mass(weights: torch.Tensor) -> torch.Tensor:
    """Causal attention maps (B, H, Tq, Tk) -> (H,): |weight| on key 0 over the row's total |weight|,
    averaged over the queries at positions >= 1 with a nonzero row (NaN for a head without any)."""
    tq, tk = weights.shape[2:]
    mass = weights.abs()  # (B, H, Tq, Tk)
    total = mass.sum(dim=-1)  # (B, H, Tq)
    rows = (total > 0) & (torch.arange(tk - tq, tk, device=weights.device) >= 1)  # (B, H, Tq)
    share = torch.where(rows, mass[..., 0] / total, 0.0)  # (B, H, Tq)
    return share.sum(dim=(0, 2)) / rows.sum(dim=(0, 2))


def keys_attended(weights: torch.Tensor) -> torch.Tensor:
    """Causal attention maps (B, H, Tq, Tk) -> (H, Tq): number of nonzero causal weights per query,
    averaged over the batch."""
    tq, tk = weights.shape[2:]
    nonzero = (weights != 0) & causal_mask(tq, tk, weights.device)  # (B, H, Tq, Tk)
    return nonzero.sum(dim=-1).to(weights.dtype).mean(dim=0)


def head_statistics(weights: torch.Tensor, position_bins: int = 4) -> dict[str, torch.Tensor]:
    """Every per-head statistic of causal attention maps (B, H, Tq, Tk), by tag name, each (H,):
    zero_frac, zero_tile_frac (where a tile lies wholly below the diagonal), sink_mass, keys_attended and
    keys_attended_pos{a}-{b} over `position_bins` equal bins
    of the query positions a..b (fewer when Tq < position_bins; a and b zero-padded to the digits of Tk - 1)."""
    check_int("position_bins", position_bins)
    tq, tk = weights.shape[2:]
    per_query = keys_attended(weights)  # (H, Tq)
    stats = {"zero_frac": zero_fraction(weights)}
    tiles = zero_tile_fraction(weights)
    if tiles is not None:
        stats["zero_tile_frac"] = tiles
    stats["sink_mass"] = sink_mass(weights)
    stats["keys_attended"] = per_query.mean(dim=-1)
    digits = len(str(tk - 1))  # zero-padded, so that dashboards sort the bins by position
    for queries in torch.arange(tq).tensor_split(min(position_bins, tq)):
        first, last = tk - tq + queries[0].item(), tk - tq + queries[-1].item()
        stats[f"keys_attended_pos{first:0{digits}d}-{last:0{digits}d}"] = per_query[:, queries].mean(dim=-1)
    return stats


def attention_image(weights: torch.Tensor, min_height: int = 128) -> torch.Tensor:
    """One sequence's maps (H, Tq, Tk) -> an RGB image (3, s*Tq, s*(H*(Tk+1)-1)) in [0, 1], enlarged
    s = ceil(min_height / Tq) times: heads side by side with a blue column between them, each query row
    scaled by its largest |weight| (positive: gray to white, negative: red, zero: black)."""
    h, tq, _ = weights.shape
    peak = weights.abs().amax(dim=-1, keepdim=True)  # (H, Tq, 1)
    scaled = (weights / torch.where(peak > 0, peak, 1.0)).float()  # (H, Tq, Tk) in [-1, 1]
    pos, neg = scaled.clamp(min=0), (-scaled).clamp(min=0)
    rgb = torch.stack([pos + neg, pos, pos])  # (3, H, Tq, Tk)
    separator = rgb.new_tensor([0.0, 0.0, 0.6])[:, None, None, None].expand(3, h, tq, 1)
    tiles = torch.cat([rgb, separator], dim=-1).permute(0, 2, 1, 3).flatten(2)[..., :-1]  # (3, Tq, H*(Tk+1)-1)
    scale = math.ceil(min_height / tq)
    return tiles.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2).cpu()


def record_attention_maps(model: nn.Module, idx: torch.Tensor) -> list[tuple[Attention, torch.Tensor]]:
    """Runs model(idx) in eval mode without gradients, each Attention layer recording its map; returns
    (layer, weights (B, H, T, T)) per layer in module order. The model's mode is restored after."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no lit_thresh.attention.Attention layer to record")
    training = model.training
    model.eval()
    for layer in layers:
        layer.record_weights = True
    try:
        with torch.no_grad():
            model(idx)
        return [(layer, layer.last_weights) for layer in layers]
    finally:
        model.train(training)
        for layer in layers:
            layer.record_weights, layer.last_weights = False, None


class AttentionDiagnostics(Callback):
    """Logs the attention statistics of the module docstring at the end of every validation (not the
    sanity check), on global rank 0, to every logger (scalars) and TensorBoard (images).

    The batch is the first `num_sequences` sequences (``batch["input_ids"]``) of the first validation
    batch, cut to their first `max_seq_len` tokens (None: whole; the maps take B*H*T^2 floats per layer),
    cached at first sight so that every validation measures the same tokens; the model runs it as
    ``pl_module(input_ids)`` under the trainer's precision. enabled: False turns the callback off;
    position_bins: number of position bins of ``keys_attended_pos{a}-{b}``.
    """

    def __init__(
        self, enabled: bool = True, num_sequences: int = 4, max_seq_len: int | None = 256, position_bins: int = 4
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        check_int("num_sequences", num_sequences)
        if max_seq_len is not None:
            check_int("max_seq_len", max_seq_len)
        check_int("position_bins", position_bins)
        self.enabled, self.num_sequences, self.max_seq_len = enabled, num_sequences, max_seq_len
        self.position_bins = position_bins
        self.input_ids: torch.Tensor | None = None  # (B, T), the fixed batch

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: dict, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.enabled and self.input_ids is None and trainer.is_global_zero and batch_idx == dataloader_idx == 0:
            self.input_ids = batch["input_ids"][: self.num_sequences, : self.max_seq_len].clone()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled or trainer.sanity_checking or not trainer.is_global_zero or self.input_ids is None:
            return
        with trainer.precision_plugin.forward_context():
            maps = record_attention_maps(pl_module, self.input_ids.to(pl_module.device))
        metrics: dict[str, float] = {}
        images: dict[str, torch.Tensor] = {}
        for index, (layer, weights) in enumerate(maps):
            prefix = f"diag/layer{index}"
            for name, per_head in head_statistics(weights, self.position_bins).items():
                metrics |= {f"{prefix}/head{h}/{name}": value for h, value in enumerate(per_head.tolist())}
            for name, value in layer.diagnostic_values().items():
                value = value.detach().float()
                if value.ndim == 0:
                    metrics[f"{prefix}/{name}"] = value.item()
                else:
                    metrics |= {f"{prefix}/head{h}/{name}": v for h, v in enumerate(value.tolist())}
            images[f"{prefix}/attention"] = attention_image(weights[0])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if isinstance(logger, TensorBoardLogger):
                for tag, image in images.items():
                    logger.experiment.add_image(tag, image, trainer.global_step)
