"""Test set-up: without CUDA, Triton kernels run on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are first imported (Triton reads it when it
decorates them), so it is set here, before any test module runs. Tests that need a GPU carry the
`gpu` marker and are deselected by default (`pytest -m gpu` runs them).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
