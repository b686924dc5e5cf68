"""The run's config, saved once: ``config.yaml`` when a fit starts, never rewritten."""

import os

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback

FIT_CONFIG = "config.yaml"


class SaveConfigOnce(SaveConfigCallback):
    """LightningCLI's SaveConfigCallback: a fit writes ``config.yaml`` into its run directory when it
    starts, and a resumed fit (``ckpt_path`` given) leaves an existing one as it is; ``validate``, ``test``
    and ``predict`` write their own ``config_<stage>.yaml`` beside it (overwriting an earlier one of theirs),
    never ``config.yaml``. A new fit into a directory that already holds a run's ``config.yaml`` is a
    ValueError: it would write over that run's logs and checkpoints."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            self.config_filename, self.overwrite = f"config_{getattr(stage, 'value', stage)}.yaml", True
            super().setup(trainer, pl_module, stage)
            return
        self.config_filename, self.overwrite = FIT_CONFIG, False
        log_dir = trainer.log_dir  # broadcast from rank 0
        started = trainer.is_global_zero and run_started(log_dir, self.config.get("ckpt_path"))
        self.already_saved = trainer.strategy.broadcast(started)  # a resumed run keeps its first config.yaml
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
