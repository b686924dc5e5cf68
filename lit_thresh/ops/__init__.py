"""Threshold rectified attention ops: Triton kernels on CUDA, blockwise PyTorch elsewhere, and a reference."""

from lit_thresh.ops.api import differential_threshold_attention, threshold_attention
from lit_thresh.ops.compat import differential_threshold_rela_triton, threshold_rela_triton
from lit_thresh.ops.reference import differential_threshold_attention_reference, threshold_attention_reference

__all__ = [
    "differential_threshold_attention",
    "differential_threshold_attention_reference",
    "differential_threshold_rela_triton",
    "threshold_attention",
    "threshold_attention_reference",
    "threshold_rela_triton",
]
