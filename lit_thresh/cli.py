"""The ``lit_thresh`` command: LightningCLI over :class:`LanguageModel` and any LightningDataModule.

``lit_thresh fit --config configs/quickstart.yaml``; ``lit_thresh --help`` lists the subcommands.
"""

import os
import sys
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_thresh import compare
from lit_thresh import data  # noqa: F401  (makes its DataModules known to --data by name)
from lit_thresh.callbacks import (
    HparamsWithMetrics,
    NaNGuard,
    PeakMemory,
    RNGState,
    SigtermCheck,
    StepCheckpoint,
    TokenThroughput,
    TrainLossProgressBar,
)
from lit_thresh.cli_errors import (
    Parser,
    check_checkpoint,
    check_checkpoint_matches,
    exit_on_input_error,
    is_file_path,
    read_checkpoint,
)
from lit_thresh.diagnostics import AttentionDiagnostics
from lit_thresh.module import LanguageModel
from lit_thresh.resume import check_data_order, check_hyperparameters, resolve_last


class LitThreshCLI(LightningCLI):
    """LightningCLI with a ``checkpoint`` group (ModelCheckpoint, the best), a ``step_checkpoint`` group
    (StepCheckpoint, last.ckpt every N steps, validation and epoch), a ``diagnostics`` group
    (AttentionDiagnostics), a ``sigterm`` group (SigtermCheck: under DDP, the ranks compare SIGTERM flags
    every 10 batches, not every batch), a RichProgressBar (TrainLossProgressBar), and the data's
    vocabulary size and longest sequence fed to the model.

    The checkpoint and progress bar step aside under ``--trainer.enable_checkpointing false`` /
    ``--trainer.enable_progress_bar false``, or when ``trainer.callbacks`` holds another progress bar.
    A ``ckpt_path`` is checked before anything runs: it must exist and hold this model's weights.

    Resuming: ``--ckpt_path last`` continues the latest run in its own directory, and model arguments that
    differ from the checkpoint's are an error (lit_thresh.resume). Checkpoints are written atomically
    (lit_thresh.checkpoint_io), ``last.ckpt`` also every ``--step_checkpoint.every_n_train_steps``;
    RNGState restores dropout's random state and NaNGuard stops at a non-finite loss or gradient.
    """

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        if subcommand := self.config.get("subcommand"):  # before anything is built
            check_checkpoint(self.config[subcommand].get("ckpt_path"), self._model_class)

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's, which overwrites the given model arguments with a checkpoint's
        hyperparameters: here ``--ckpt_path last`` becomes the run it resumes (lit_thresh.resume.resolve_last),
        and hyperparameters that differ from the checkpoint's are an error (after_instantiate_classes)."""
        if subcommand := self.config.get("subcommand"):
            resolve_last(self.config[subcommand], fit=subcommand == "fit")

    def after_instantiate_classes(self) -> None:
        self.model.check_data_lengths(self.datamodule)  # before any run directory or config.yaml is written
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if is_file_path(ckpt_path):  # it exists: check_checkpoint
            checkpoint = read_checkpoint(ckpt_path)  # once, memory-mapped, for the three checks
            check_checkpoint_matches(ckpt_path, checkpoint, self.model)
            check_hyperparameters(ckpt_path, checkpoint, self.model)
            if subcommand == "fit":
                check_data_order(checkpoint, self.datamodule, self.trainer.world_size)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ModelCheckpoint, "checkpoint")
        parser.add_class_arguments(StepCheckpoint, "step_checkpoint")  # last.ckpt every N steps; 0: off
        parser.link_arguments("checkpoint.dirpath", "step_checkpoint.dirpath")
        parser.add_class_arguments(AttentionDiagnostics, "diagnostics")  # off: --diagnostics.enabled false
        parser.add_class_arguments(SigtermCheck, "sigterm")  # Lightning's every batch: --sigterm.every_n_batches 1
        parser.set_defaults({"checkpoint.monitor": "val/loss"})  # last.ckpt: step_checkpoint's
        parser.set_defaults({"checkpoint.enable_version_counter": False})  # step_checkpoint writes last.ckpt too
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_seq_len", "model.max_seq_len", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer")
        callbacks = config["callbacks"] or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if config["enable_checkpointing"] is not False:
            callbacks.append(self._get(self.config_init, "checkpoint"))
            callbacks.append(self._get(self.config_init, "step_checkpoint"))
        if config["enable_progress_bar"] is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(TrainLossProgressBar())
        callbacks.append(self._get(self.config_init, "diagnostics"))
        callbacks.append(self._get(self.config_init, "sigterm"))
        trainer = super().instantiate_trainer(callbacks=callbacks, **kwargs)
        one_thread_per_process(trainer)
        return trainer


def one_thread_per_process(trainer: Trainer) -> None:
    """With OMP_NUM_THREADS unset, each process training on a GPU, or one of several on this machine,
    runs its CPU ops on one thread, as torchrun's default (torch's own default is every core; Lightning's
    launcher leaves it). Its CPU work is then only queueing GPU kernels and gathering small batches, and
    a pool of threads woken for each small op slows it: on one H200, MQAR softmax at batch 256 took 22.3
    ms a step with every core and 12.6 ms with one; on two, the ranks' threads fought over the cores and
    one step in four took 40-70 ms instead of 27. Training on the CPU keeps its threads (one process)."""
    several = trainer.num_devices > 1
    if (several or isinstance(trainer.accelerator, CUDAAccelerator)) and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        why = "several devices" if several else "a GPU"
        rank_zero_info(f"lit_thresh: 1 CPU thread per process (OMP_NUM_THREADS unset, {why})")


def build_cli(args: ArgsType = None, run: bool = True) -> LitThreshCLI:
    """The ``lit_thresh`` command's LightningCLI; with ``run=False`` it only builds model, data and trainer."""
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return LitThreshCLI(
        LanguageModel,
        LightningDataModule,
        subclass_mode_data=True,
        parser_class=Parser,  # short error messages
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the model owns its optimizer and schedule
        trainer_defaults={
            "precision": "bf16-mixed" if bf16 else "32-true",
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "lightning_logs", "name": "default", "default_hp_metric": False},
            },
            "callbacks": [HparamsWithMetrics(), TokenThroughput(), PeakMemory(), RNGState(), NaNGuard()],
            "plugins": {"class_path": "lit_thresh.checkpoint_io.AtomicCheckpointIO"},
        },
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of ``lit_thresh`` and ``python -m lit_thresh``; ``lit_thresh compare ...`` runs
    lit_thresh.compare.

    Bad input ends the program with one line, ``lit_thresh: error: <message>``, and exit status 1 (2 for
    parse errors); ``LIT_THRESH_TRACEBACK=1`` shows the traceback (lit_thresh.cli_errors)."""
    argv = sys.argv[1:] if args is None else args
    with exit_on_input_error():
        if isinstance(argv, list) and argv[:1] == ["compare"]:
            compare.main(argv[1:])
            return
        build_cli(args)
