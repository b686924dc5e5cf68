"""The ``lit_thresh`` command: LightningCLI over :class:`LanguageModel` and any LightningDataModule.

``lit_thresh fit --config configs/quickstart.yaml``; ``lit_thresh --help`` lists the subcommands.
"""

import importlib
import logging
import os
import signal
import sys
import warnings
from typing import Any

# Before torch loads OpenMP (it reads this once): threads with no work sleep instead of spinning, so that
# on a busy CPU they leave the cores to the threads that have work (see one_thread_per_process).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_thresh import compare
from lit_thresh import data  # noqa: F401  (makes its DataModules known to --data by name)
from lit_thresh.callbacks import (
    HparamsWithMetrics,
    MetricsTable,
    ModelSummaryTable,
    NaNGuard,
    PeakMemory,
    ProgressLog,
    RNGState,
    SigtermCheck,
    StepCheckpoint,
    TokenThroughput,
    TrainLossProgressBar,
)
from lit_thresh.callbacks.run_config import SaveConfigOnce, check_run_dir
from lit_thresh.cli_errors import Parser, exit_on_input_error
from lit_thresh.diagnostics import AttentionDiagnostics
from lit_thresh.lightning_compat import CkptPathCLI, add_subcommand, model_class
from lit_thresh.module import LanguageModel
from lit_thresh.preflight import check_optimization, check_val_check_interval
from lit_thresh.resume import check_run, lock_run, read_for_run


# The callbacks every run gets, each a config group that prints in --print_config: its options
# (`--nan_guard.deferred true`), or null to switch it off (`--nan_guard null`). Group -> class, init args.
DEFAULT_CALLBACKS: dict[str, tuple[type[Callback], dict[str, Any]]] = {
    "progress_bar": (TrainLossProgressBar, {}),  # off also under --trainer.enable_progress_bar false
    "progress_log": (ProgressLog, {}),  # off a terminal: a plain line every N steps
    "model_summary": (ModelSummaryTable, {}),  # off also under --trainer.enable_model_summary false
    "hparams": (HparamsWithMetrics, {}),
    "metrics_table": (MetricsTable, {}),
    "throughput": (TokenThroughput, {}),
    "lr_monitor": (LearningRateMonitor, {"logging_interval": "step"}),  # needs a logger
    "peak_memory": (PeakMemory, {}),
    "rng_state": (RNGState, {}),
    "nan_guard": (NaNGuard, {}),
}
DEFAULT_LOG_DIR = "lightning_logs"  # the TensorBoardLogger's save_dir, under trainer.default_root_dir if set
# What Lightning prints on every run that says nothing about this one (rank_zero_info messages).
QUIET_MESSAGES = (
    "GPU available:",
    "TPU available:",
    "💡 Tip:",
    "Loading `train_dataloader` to estimate",
    "Trainer already configured with model summary callbacks",  # ours: ModelSummaryTable
    "You are using a CUDA device",  # the TF32 tip: the configs train in bf16 mixed precision
)
# Lightning's warnings on every GPU run that need no action here: the DataModules gather batches from
# memory without workers by design; the H200's peak FLOPs (for MFU) and bf16 model sizes are unknown to it.
QUIET_WARNINGS = (
    r"The '\w+_dataloader' does not have many workers",
    r"FLOPs not found for",
    r"Precision .* is not supported by the model summary",
)


class LitThreshCLI(CkptPathCLI):
    """LightningCLI with a ``checkpoint`` group (ModelCheckpoint, the best), a ``step_checkpoint`` group
    (StepCheckpoint, last.ckpt every N steps, validation and epoch), a ``diagnostics`` group
    (AttentionDiagnostics), a ``sigterm`` group (SigtermCheck: under DDP, the ranks compare SIGTERM flags
    every 10 batches, not every batch), a group per DEFAULT_CALLBACKS entry (null: off; among them a
    LearningRateMonitor), and the data's vocabulary size and longest sequence fed to the model.

    The checkpoints, progress bar and model summary step aside under ``--trainer.enable_checkpointing
    false`` / ``enable_progress_bar false`` / ``enable_model_summary false``, or when ``trainer.callbacks``
    holds another progress bar or summary. A ``ckpt_path`` is checked before anything runs: it must exist
    and hold this model's weights. ``config.yaml`` is written once, when a fit starts (SaveConfigOnce);
    ``--trainer.default_root_dir`` moves the logs and checkpoints (place_logs_under_root_dir); validate and
    test print one table of their metrics (MetricsTable); a fit stopped by SIGTERM exits with status 143.

    Resuming: ``--ckpt_path last`` continues the latest run in its own directory, and model arguments that
    differ from the checkpoint's are an error (lit_thresh.resume). Checkpoints are written atomically
    (lit_thresh.checkpoint_io), ``last.ckpt`` also every ``--step_checkpoint.every_n_train_steps``;
    RNGState restores dropout's random state and NaNGuard stops at a non-finite loss or gradient.
    """

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if add_subcommands:  # `lit_thresh compare`: not a Trainer method, so added to Lightning's four
            add_subcommand(self.parser, "compare", compare.build_parser(), help=compare.HELP)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        if self.config.get("subcommand") == "compare":  # runs the comparison, then exits: nothing to build
            sys.exit(compare.run(self.config.compare))

    def read_ckpt_path(self) -> None:
        """Replaces LightningCLI's reading of ``ckpt_path`` (CkptPathCLI), which overwrites the given model
        arguments with a checkpoint's hyperparameters: here the checkpoint (for ``--ckpt_path last``, the
        run's it resumes) is read once and checked before anything is built (lit_thresh.resume.read_for_run),
        and hyperparameters that differ from the checkpoint's are an error (after_instantiate_classes)."""
        self._checkpoint = None
        if subcommand := self.config.get("subcommand"):
            place_logs_under_root_dir(self.config[subcommand])  # `last` is looked up where the logs go
            self._checkpoint = read_for_run(self.config[subcommand], model_class(self), fit=subcommand == "fit")

    def after_instantiate_classes(self) -> None:
        """Everything checkable before any run directory or config.yaml is written: the data's lengths for
        the model, the optimizer and schedule settings, a fit's validation interval, the checkpoint against
        the built model and data (lit_thresh.resume.check_run)."""
        subcommand = self.config.get("subcommand")
        self.model.check_data_lengths(self.datamodule)
        check_optimization(self.model)
        if subcommand == "fit":
            check_val_check_interval(self.trainer, self.datamodule)
        if self._checkpoint is not None:
            num_replicas = self.trainer.world_size if subcommand == "fit" else None
            ckpt_path = self.config[subcommand].ckpt_path
            check_run(ckpt_path, self._checkpoint, self.model, self.datamodule, num_replicas)
            self._checkpoint = None  # its memory map is no longer needed

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's, without validate's and test's ``verbose``: MetricsTable prints their metrics."""
        commands = LightningCLI.subcommands()
        return commands | {name: commands[name] | {"verbose"} for name in ("validate", "test")}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for key, (callback, init_args) in DEFAULT_CALLBACKS.items():
            parser.add_argument(
                f"--{key}",
                type=callback | None,
                # a class_path spec, not jsonargparse.lazy_instance, which walks inspect.stack() in each of its
                # 40 calls per command (10 callbacks, 4 subcommands): seconds inside a deep stack such as pytest's
                default={"class_path": f"{callback.__module__}.{callback.__qualname__}"} | (
                    {"init_args": init_args} if init_args else {}),
                help=f"{callback.__name__} ({callback.__module__}); null: off",
            )
        parser.add_class_arguments(ModelCheckpoint, "checkpoint")
        parser.add_class_arguments(StepCheckpoint, "step_checkpoint")  # last.ckpt every N steps; 0: off
        parser.link_arguments("checkpoint.dirpath", "step_checkpoint.dirpath")
        parser.add_class_arguments(AttentionDiagnostics, "diagnostics")  # off: --diagnostics.enabled false
        parser.add_class_arguments(SigtermCheck, "sigterm")  # Lightning's every batch: --sigterm.every_n_batches 1
        parser.set_defaults({"checkpoint.monitor": "val/loss"})  # last.ckpt: step_checkpoint's
        parser.set_defaults({"checkpoint.enable_version_counter": False})  # step_checkpoint writes last.ckpt too
        # Ranks after validations only, where its val/ metric is: not also when a run stops mid-epoch (max_steps,
        # a resume's end) with none, which warns that the monitored key is missing.
        parser.set_defaults({"checkpoint.save_on_train_epoch_end": False})
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_seq_len", "model.config.max_seq_len", apply_on="instantiate")

    def init_value(self, key: str) -> Any:
        """The built value of `key` in this subcommand's config (config_init)."""
        return self.config_init.get(f"{self.subcommand}.{key}" if self.subcommand else key)

    def before_instantiate_classes(self) -> None:
        place_logs_under_root_dir(self.config.get(self.subcommand) if self.subcommand else self.config)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.init_value("trainer")
        callbacks = config["callbacks"] or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if config["enable_checkpointing"] is not False:
            callbacks.append(self.init_value("checkpoint"))
            callbacks.append(self.init_value("step_checkpoint"))
        given = [type(callback) for callback in callbacks]
        skip = {  # default callbacks that step aside
            "progress_bar": config["enable_progress_bar"] is False or any(issubclass(c, ProgressBar) for c in given),
            "model_summary": config["enable_model_summary"] is False or any(issubclass(c, ModelSummary) for c in given),
            "lr_monitor": config["logger"] is False or config["logger"] == [],
        }
        for key in DEFAULT_CALLBACKS:
            if (callback := self.init_value(key)) is not None and not skip.get(key):
                callbacks.append(callback)
        callbacks.append(self.init_value("diagnostics"))
        callbacks.append(self.init_value("sigterm"))
        trainer = super().instantiate_trainer(callbacks=callbacks, **kwargs)
        one_thread_per_process(trainer)
        return trainer

    def fit(self, **kwargs: Any) -> None:
        """trainer.fit; a fit stopped by SIGTERM (after StepCheckpoint saved last.ckpt) exits with status
        143 (128 + SIGTERM), so that schedulers and ``lit_thresh compare`` do not take it for finished.
        A new fit into a directory that holds a run already is refused first (check_run_dir, once, before
        the launcher starts other ranks); the fit holds the lock of the folders its checkpoints go to
        (lit_thresh.resume.lock_run)."""
        check_run_dir(self.trainer, kwargs.get("ckpt_path"))
        lock_run(self.trainer)  # a second process resuming this run is refused until this fit ends
        try:
            self.trainer.fit(**kwargs)
        except SIGTERMException:
            print(
                f"lit_thresh: fit stopped by SIGTERM at step {self.trainer.global_step}; "
                "continue it with --ckpt_path last",
                file=sys.stderr,
            )
            raise SystemExit(128 + signal.SIGTERM) from None

    def validate(self, **kwargs: Any) -> None:
        self.trainer.validate(verbose=False, **kwargs)  # MetricsTable prints one table

    def test(self, **kwargs: Any) -> None:
        self.trainer.test(verbose=False, **kwargs)  # MetricsTable prints one table


def place_logs_under_root_dir(config: Any) -> None:
    """With ``trainer.default_root_dir`` set and the TensorBoardLogger's ``save_dir`` left at
    DEFAULT_LOG_DIR, the logs (and the checkpoints in them) go to ``<default_root_dir>/lightning_logs``."""
    root, logger = config.get("trainer.default_root_dir"), config.get("trainer.logger")
    args = getattr(logger, "init_args", None)
    if root is None or args is None or getattr(args, "save_dir", None) != DEFAULT_LOG_DIR:
        return
    module, _, name = logger.class_path.rpartition(".")
    if issubclass(getattr(importlib.import_module(module), name), TensorBoardLogger):
        args.save_dir = os.path.join(root, DEFAULT_LOG_DIR)


class QuietFilter(logging.Filter):
    """Drops Lightning's QUIET_MESSAGES."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_MESSAGES)


QUIET_FILTER = QuietFilter()


def quiet_lightning() -> None:
    """Leaves out what Lightning and torch print on every run that says nothing about it: the device
    availability lines, Lightning's product tips (QUIET_MESSAGES), its warnings in QUIET_WARNINGS and
    torch's deprecation of the pytree LeafSpec that Lightning still uses. (The model summary's ``Total FLOPs: 0`` and the progress bar's
    ``v_num``: ModelSummaryTable, TrainLossProgressBar.)"""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(QUIET_FILTER)
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message)


def one_thread_per_process(trainer: Trainer) -> None:
    """With OMP_NUM_THREADS unset, each process training on a GPU, or one of several on this machine,
    runs its CPU ops on one thread, as torchrun's default (torch's own default is every core; Lightning's
    launcher leaves it). Its CPU work is then only queueing GPU kernels and gathering small batches, and
    a pool of threads woken for each small op slows it: on one H200, MQAR softmax at batch 256 took 22.3
    ms a step with every core and 12.6 ms with one; on two, the ranks' threads fought over the cores and
    one step in four took 40-70 ms instead of 27. Training on the CPU keeps its threads (one process);
    there, OMP_WAIT_POLICY=PASSIVE (set when this module loads, unless set already) lets a busy core slow
    it gracefully: torch's OpenMP threads otherwise spin while they wait for the thread on the busy core.
    60 quickstart steps on a shared 2-core machine with a busy loop on one core: 364 s spinning, 57 s
    passive (84 s on one thread)."""
    several = trainer.num_devices > 1
    if (several or isinstance(trainer.accelerator, CUDAAccelerator)) and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        why = "several devices" if several else "a GPU"
        rank_zero_info(f"lit_thresh: 1 CPU thread per process (OMP_NUM_THREADS unset, {why})")


def build_cli(args: ArgsType = None, run: bool = True) -> LitThreshCLI:
    """The ``lit_thresh`` command's LightningCLI; with ``run=False`` it only builds model, data and trainer."""
    quiet_lightning()
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return LitThreshCLI(
        LanguageModel,
        LightningDataModule,
        subclass_mode_data=True,
        parser_class=Parser,  # short error messages
        seed_everything_default=1234,
        save_config_callback=SaveConfigOnce,  # config.yaml once, when a fit starts
        auto_configure_optimizers=False,  # the model owns its optimizer and schedule
        trainer_defaults={
            "precision": "bf16-mixed" if bf16 else "32-true",
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": DEFAULT_LOG_DIR, "name": "default", "default_hp_metric": False},
            },
            "plugins": {"class_path": "lit_thresh.checkpoint_io.AtomicCheckpointIO"},
        },
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of ``lit_thresh`` and ``python -m lit_thresh``.

    Bad input ends the program with one line, ``lit_thresh: error: <message>``, and exit status 1 (2 for
    parse errors); ``LIT_THRESH_TRACEBACK=1`` shows the traceback (lit_thresh.cli_errors)."""
    with exit_on_input_error():
        build_cli(args)
