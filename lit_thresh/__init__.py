"""lit_thresh: softmax vs threshold rectified attention, Triton kernels and Lightning tooling."""

__version__ = "0.1.0"
