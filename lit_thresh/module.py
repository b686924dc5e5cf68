"""LightningModule for next-token language modelling: loss, metrics, optimizer and schedule."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Literal, get_args

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from torch import nn

from lit_thresh.lightning_compat import should_update_logs
from lit_thresh.metrics import IGNORE_INDEX, token_metrics, update_token_metrics
from lit_thresh.model import Transformer, TransformerConfig
from lit_thresh.schedule import WarmupCosine

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]  # torch.compile's


class LanguageModel(L.LightningModule):
    """A Transformer (lit_thresh.model) trained with cross-entropy on batch["labels"] (IGNORE_INDEX = not supervised).

    config: the Transformer's architecture (lit_thresh.model.TransformerConfig; YAML `model.config.*`).
    compile: torch.compile the model (see configure_model); True or a torch.compile mode, e.g.
    "reduce-overhead" (CUDA graphs). optimizer: called with two parameter groups, the >= 2-D weights
    (decayed) and the rest (weight_decay 0); lr_scheduler: called with the optimizer, stepped every step
    (None = constant lr; a WarmupCosine without max_steps lasts the trainer's max_steps, see
    configure_optimizers). Logs `train/{loss,acc}` every `log_every_n_steps` (see training_step) and
    `val/{loss,acc,ppl}` (`val/<name>/...` for the DataModule's other `val_set_names`), same for test.
    """

    def __init__(
        self,
        config: TransformerConfig,
        compile: bool | CompileMode = False,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = WarmupCosine,
    ) -> None:
        super().__init__()
        if not isinstance(compile, bool) and compile not in get_args(CompileMode):
            raise ValueError(f"compile must be true, false or one of {get_args(CompileMode)}, got {compile!r}")
        self.save_hyperparameters()
        self.model = Transformer(config)
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_metrics = token_metrics(config.vocab_size, training=True)  # perplexity = exp(train/loss)
        self.eval_metrics = nn.ModuleDict()  # "val" / "test" -> one token_metrics per data set, see setup
        self.eval_prefixes: dict[str, list[str]] = {}
        self.last_batch_shape: tuple[int, int] | None = None  # (B, T) of the last step, for flops_per_batch
        self.train_seq_len: int | None = None  # the DataModule's training length, see setup and _compiled

    def setup(self, stage: str) -> None:
        """One set of metrics per validation and test set, named by the DataModule's
        `val_set_names` / `test_set_names` if it has them (the first set logs as plain `val/...`).
        The DataModule's lengths are checked first (check_data_lengths)."""
        data = self.trainer.datamodule
        self.check_data_lengths(data)
        self.train_seq_len = getattr(data, "train_seq_len", None)
        for split in ("val", "test"):
            names = getattr(data, f"{split}_set_names", None) or [split]
            self.eval_prefixes[split] = [split] + [f"{split}/{name}" for name in names[1:]]
            self.eval_metrics[split] = nn.ModuleList(token_metrics(self.model.config.vocab_size) for _ in names)

    def check_data_lengths(self, data: object) -> None:
        """With learned positions, refuses a DataModule whose `max_seq_len` exceeds its `train_seq_len`
        (length test sets): positions beyond the training length were never trained."""
        train_len, longest = getattr(data, "train_seq_len", None), getattr(data, "max_seq_len", None)
        if self.model.config.positional == "learned" and train_len is not None and longest > train_len:
            raise ValueError(
                f"positional='learned' cannot evaluate sequences of {longest} tokens after training on "
                f"{train_len}: learned absolute positions cannot extrapolate beyond the training length. "
                "Use --model.config.positional rope or none, or set the data's test_length_multipliers to []."
            )

    def configure_model(self) -> None:
        """With `compile`, torch.compile the Transformer in place (same parameter names, so checkpoints
        load either way): fused kernels and far fewer launches, on GPU mostly; compiles on first use.
        "reduce-overhead" also replays the forward and backward passes as CUDA graphs: one launch each,
        for small models whose steps the CPU's kernel launches would otherwise pace. What is not compiled
        runs eagerly (see _compiled): batches of another length than the training one (the length test
        sets: each new length would compile and record its graphs again) and KV-cache generation."""
        if self.hparams.compile:
            self.model.compile(mode=None if self.hparams.compile is True else self.hparams.compile)

    def _compiled(self, seq_len: int | None) -> contextlib.AbstractContextManager:
        """The context a forward pass of `seq_len` tokens runs in: the compiled model for the training
        length, else eagerly (torch.compiler.set_stance("force_eager")); None: eagerly (generation)."""
        if not self.hparams.compile:
            return contextlib.nullcontext()
        if seq_len is not None and self.train_seq_len in (None, seq_len):
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> next-token logits (B, T, V)."""
        return self.model(idx)

    def _step(self, batch: dict[str, torch.Tensor], metrics: nn.ModuleDict) -> torch.Tensor:
        """The batch's loss; feeds the batch to `metrics`."""
        labels = batch["labels"]  # (B, T)
        self.last_batch_shape = tuple(labels.shape)
        with self._compiled(labels.shape[1]):
            if self.hparams.compile in ("reduce-overhead", "max-autotune"):  # the modes that use CUDA graphs
                torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs are done with
            logits = self(batch["input_ids"])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        update_token_metrics(metrics, loss, logits, labels)
        return loss

    @functools.cached_property
    def n_params(self) -> int:
        """Number of parameters (the tied embedding / LM head counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def flops_per_batch(self) -> int | None:
        """FLOPs of the last batch by nanoGPT's (PaLM's) estimate, (2 N + 4 L d T) per token and three
        times that when training (forward + backward); read by lightning's ThroughputMonitor for MFU."""
        if self.last_batch_shape is None:
            return None
        batch, seq_len = self.last_batch_shape
        per_token = 2 * self.n_params + 4 * self.model.config.n_layers * self.model.config.d_model * seq_len
        return (3 if self.training else 1) * per_token * batch * seq_len

    def _eval_step(self, batch: dict[str, torch.Tensor], split: str, dataloader_idx: int) -> None:
        prefixes = self.eval_prefixes[split]
        if dataloader_idx >= len(prefixes):
            raise ValueError(
                f"{split} dataloader {dataloader_idx} has no name: a DataModule with several {split} "
                f"dataloaders must expose `{split}_set_names`, one name per dataloader"
            )
        prefix = prefixes[dataloader_idx]
        metrics = self.eval_metrics[split][dataloader_idx]
        self._step(batch, metrics)
        for name, metric in metrics.items():  # computed and synced by Lightning at the end of the epoch
            self.log(f"{prefix}/{name}", metric, add_dataloader_idx=False, prog_bar=prefix == split)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Logs `train/{loss,acc}` on the steps the loggers write (every `log_every_n_steps`, and the last
        batch of an epoch): the token-weighted means over all batches (and ranks) since the last write.
        Nothing is logged on the other steps: each `self.log` costs CPU time that the next step's queueing
        of GPU work needs (the CLI's TrainLossProgressBar shows the loss of the logged steps)."""
        loss = self._step(batch, self.train_metrics)
        trainer = self.trainer
        if should_update_logs(trainer) or trainer.is_last_batch:  # Lightning's test for writing
            for name, metric in self.train_metrics.items():
                self.log(f"train/{name}", metric.compute(), on_step=True, on_epoch=False)
                metric.reset()
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, "val", dataloader_idx)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, "test", dataloader_idx)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Greedy next-token predictions (B, T) of batch["input_ids"] (full logits would be (B, T, V))."""
        return self(batch["input_ids"]).argmax(dim=-1)

    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Continues the prompts idx (B, T) by max_new_tokens tokens with a KV cache; see Transformer.generate.
        Eager under `compile`: every step has another length."""
        with self._compiled(None):
            return self.model.generate(idx, max_new_tokens, temperature, top_k)

    def on_train_start(self) -> None:
        rank_zero_info(f"{type(self.model.blocks[0].attn).__name__} model: {self.n_params:,} parameters")
        self.log("n_params", float(self.n_params), sync_dist=True)  # the same on every rank

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, also for optimizers that unscale gradients themselves (`fused=True` AdamW):
        Lightning refuses to clip those under mixed precision because a GradScaler's gradients are still
        scaled at this point, but bf16 has no GradScaler, so there is nothing to unscale."""
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None and gradient_clip_val:
            algorithm = GradClipAlgorithmType((gradient_clip_algorithm or "norm").lower())  # ValueError if unknown
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer(
            [
                {"params": [p for p in params if p.dim() >= 2]},  # matmul and embedding weights
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norms, beta, lambda
            ]
        )
        if self.lr_scheduler is None:
            return optimizer
        scheduler = self.lr_scheduler(optimizer)
        if isinstance(scheduler, WarmupCosine) and scheduler.max_steps is None:
            total_steps = self.trainer.estimated_stepping_batches  # inf when training length is unbounded
            if math.isfinite(total_steps):
                scheduler.max_steps = int(total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
