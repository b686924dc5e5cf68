"""The ``lit_thresh`` command: LightningCLI over :class:`LanguageModel` and any LightningDataModule.

``lit_thresh fit --config configs/quickstart.yaml``; ``lit_thresh --help`` lists the subcommands.
"""

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lit_thresh import data  # noqa: F401  (makes its DataModules known to --data by name)
from lit_thresh.callbacks import HparamsWithMetrics
from lit_thresh.module import LanguageModel


class LitThreshCLI(LightningCLI):
    """LightningCLI with a ``checkpoint`` group (ModelCheckpoint, last + best), a RichProgressBar, and the
    data's vocabulary size and longest sequence fed to the model.

    The checkpoint and progress bar step aside under ``--trainer.enable_checkpointing false`` /
    ``--trainer.enable_progress_bar false``, or when ``trainer.callbacks`` holds another progress bar.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": "val/loss", "checkpoint.save_last": True})
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_seq_len", "model.max_seq_len", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer")
        callbacks = config["callbacks"] or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if config["enable_checkpointing"] is not False:
            callbacks.append(self._get(self.config_init, "checkpoint"))
        if config["enable_progress_bar"] is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RichProgressBar())
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)


def build_cli(args: ArgsType = None, run: bool = True) -> LitThreshCLI:
    """The ``lit_thresh`` command's LightningCLI; with ``run=False`` it only builds model, data and trainer."""
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return LitThreshCLI(
        LanguageModel,
        LightningDataModule,
        subclass_mode_data=True,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the model owns its optimizer and schedule
        trainer_defaults={
            "precision": "bf16-mixed" if bf16 else "32-true",
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "lightning_logs", "name": "default", "default_hp_metric": False},
            },
            "callbacks": [HparamsWithMetrics()],
        },
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of ``lit_thresh`` and ``python -m lit_thresh``."""
    build_cli(args)
