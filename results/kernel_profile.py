"""CUDA time per kernel of one forward+backward, from torch.profiler: the single op, the fused differential op
and SDPA-cuDNN, bf16, p = 2, beta and lambda (H,) learnable, q, k, v ~ 0.5 N(0, 1) (the bench's grid inputs),
H = 16, B * T = 16384, at D = 128, T = 4096 and 16384. Each call warmed up, then 10 calls profiled; the table
gives each kernel's mean time per call (us) and its share of the call's CUDA time:

    python results/kernel_profile.py

Output of session 34 (one H100) in results/kernel_profile_2026-12-07_h100.txt.
"""

import collections

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from lit_thresh.ops import differential_threshold_attention, threshold_attention

TOKENS, H, D, CALLS = 16384, 16, 128, 10


def calls(t: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, q2, k, k2, v, dout = (0.5 * torch.randn(TOKENS // t, H, t, D, device="cuda", dtype=torch.bfloat16,
                                               generator=gen) for _ in range(6))  # (B, H, T, D)
    beta = torch.full((H,), 0.5, device="cuda")
    lam = torch.full((H,), 0.3, device="cuda")

    def leaves(*x):
        return [a.detach().requires_grad_() for a in x]

    def single():
        threshold_attention(*leaves(q, k, v, beta), 2.0).backward(dout)

    def fused():
        differential_threshold_attention(*leaves(q, q2, k, k2, v, beta, lam), 2.0).backward(dout)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(*leaves(q, k, v), is_causal=True).backward(dout)

    return {"threshold (single op)": single, "differential fused": fused, "sdpa cudnn": cudnn}


def main() -> None:
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; bf16, D = {D}, H = {H}, B * T = {TOKENS}")
    for t in (4096, 16384):
        for name, fn in calls(t).items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    fn()
                torch.cuda.synchronize()
            per_kernel = collections.Counter()
            for evt in prof.events():
                if evt.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[evt.name] += evt.device_time / CALLS
            total = sum(per_kernel.values())
            print(f"\nT = {t}, {name}: {total:.0f} us of CUDA time per forward+backward")
            for kernel, us in per_kernel.most_common():
                if us >= 0.005 * total:
                    print(f"  {us:9.1f} us {100 * us / total:5.1f}%  {kernel[:110]}")


if __name__ == "__main__":
    main()
