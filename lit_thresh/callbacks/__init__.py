"""Callbacks shared by every ``lit_thresh`` run."""

from lit_thresh.callbacks.monitoring import (
    HparamsWithMetrics,
    MetricsTable,
    ModelSummaryTable,
    PeakMemory,
    ProgressLog,
    TokenThroughput,
    TrainLossProgressBar,
    batch_size,
    batch_tokens,
)
from lit_thresh.callbacks.reliability import NaNGuard, RNGState, SigtermCheck, StepCheckpoint

__all__ = [
    "HparamsWithMetrics",
    "MetricsTable",
    "ModelSummaryTable",
    "NaNGuard",
    "PeakMemory",
    "ProgressLog",
    "RNGState",
    "SigtermCheck",
    "StepCheckpoint",
    "TokenThroughput",
    "TrainLossProgressBar",
    "batch_size",
    "batch_tokens",
]
