"""The run's config, saved once: ``config.yaml`` when a fit starts, never rewritten."""

import os

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_only

FIT_CONFIG = "config.yaml"


class SaveConfigOnce(SaveConfigCallback):
    """LightningCLI's SaveConfigCallback: a fit writes ``config.yaml`` into its run directory when it
    starts, and a resumed fit (``ckpt_path`` given) leaves an existing one as it is; ``validate``, ``test``
    and ``predict`` write their own ``config_<stage>.yaml`` beside it (overwriting an earlier one of theirs),
    never ``config.yaml``.

    Whether the run directory holds a run already is decided once, before the fit starts, by the launching
    process (check_run_dir, which refuses a new fit over a run); every rank takes its answer here. A fit
    that did not ask check_run_dir (a Trainer driven directly, after ``build_cli(run=False)``) gets
    Lightning's own check: a RuntimeError on every rank when ``config.yaml`` exists."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            self.config_filename, self.overwrite = f"config_{getattr(stage, 'value', stage)}.yaml", True
            super().setup(trainer, pl_module, stage)
            return
        self.config_filename, self.overwrite = FIT_CONFIG, False
        self.already_saved = trainer.strategy.broadcast(self.already_saved)  # rank 0's, from check_run_dir
        super().setup(trainer, pl_module, stage)


def run_started(log_dir: str | None, ckpt_path: str | None) -> bool:
    """Whether the run directory `log_dir` holds a fit's ``config.yaml`` already: True when a fit resumes
    it (`ckpt_path` given); a ValueError for a new fit, which would write over that run."""
    if not log_dir or not os.path.isfile(os.path.join(log_dir, FIT_CONFIG)):
        return False
    if ckpt_path is None:
        raise ValueError(
            f"{log_dir} already holds a run ({FIT_CONFIG}): a new fit would write over it; resume it with "
            "--ckpt_path, or leave trainer.logger.init_args.version unset for a new run directory"
        )
    return True


def check_run_dir(trainer: Trainer, ckpt_path: str | None) -> None:
    """The one check of the run directory a fit of `trainer` writes into (``trainer.log_dir``, run_started),
    made by the launching process before the fit starts, and so before a DDP launcher starts the other
    ranks: a ValueError for a new fit over a run; for a resume, the trainer's SaveConfigOnce keeps the
    run's ``config.yaml`` (on every rank: they take this process's answer in its setup)."""
    if rank_zero_only.rank != 0:
        return
    started = run_started(trainer.log_dir, ckpt_path)
    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigOnce):
            callback.already_saved = started
