"""Callbacks shared by every ``lit_thresh`` run."""

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info


class HparamsWithMetrics(Callback):
    """Fill TensorBoard's HPARAMS tab: at the end of fit and test, log the run's hyperparameters with its
    final metrics (``trainer.callback_metrics``), and print those metrics.

    Meant for ``TensorBoardLogger(default_hp_metric=False)``, which records the hyperparameters at start
    but writes no HPARAMS entry until it is given metrics.
    """

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)

    @staticmethod
    def _log(trainer: Trainer) -> None:
        metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
        rank_zero_info("Final metrics: " + ", ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items())))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(logger.hparams, metrics, step=trainer.global_step)
