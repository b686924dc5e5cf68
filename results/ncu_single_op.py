"""The workload that results/ncu_*_2026-12-07_h100.txt profiled: two forward+backward calls at bf16, B = 4, H = 16,
T = 4096, D = 128, q, k, v ~ 0.5 N(0, 1), p = 2, beta (H,) = 0.5 learnable, of the single op (`threshold`) or of
SDPA-cuDNN (`cudnn`). Nsight Compute (its default base clocks; metrics of each kernel's first launch):

    ncu -k regex:"threshold_(fwd|bwd_dkv|bwd_dq)_kernel" -c 3 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section MemoryWorkloadAnalysis python results/ncu_single_op.py threshold
    ncu -k regex:"sdpa|fmha|flash|cudnn|bprop|fprop" -c 6 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python results/ncu_single_op.py cudnn
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_thresh.ops import threshold_attention


def main(which: str) -> None:
    torch.manual_seed(0)
    b, h, t, d = 4, 16, 4096, 128
    q, k, v, dout = (0.5 * torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))  # (B, H, T, D)
    beta = torch.full((h,), 0.5, device="cuda", requires_grad=True)
    for _ in range(2):
        if which == "threshold":
            threshold_attention(q, k, v, beta, 2.0).backward(dout)
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("threshold", "cudnn"):
        sys.exit("usage: python results/ncu_single_op.py threshold|cudnn")
    main(sys.argv[1])
