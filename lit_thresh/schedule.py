"""Learning-rate schedule: linear warmup, then cosine decay (nanoGPT)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """lr * (s + 1) / (warmup_steps + 1) for steps s < warmup_steps, then a cosine from lr down to
    min_lr_ratio * lr at max_steps, constant after. Step it every optimizer step.

    max_steps None: LanguageModel sets it to the trainer's estimated_stepping_batches; until it is
    set (or if training length is unbounded) the lr stays at its peak after warmup.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < warmup_steps):
            raise ValueError(f"max_steps must be None or an int >= warmup_steps ({warmup_steps}), got {max_steps!r}")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        super().__init__(optimizer, self.lr_factor, last_epoch)

    def lr_factor(self, step: int) -> float:
        """The multiplier of the base lr at `step`."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.max_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
