"""lit_thresh.profile: kernel names sorted into parts of the step, the per-step breakdown and run summaries."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from lit_thresh.profile import KernelBreakdown, breakdown, kernel_part, main, run_summary


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("threshold_fwd_kernel", "attention_forward"),
        ("threshold_bwd_dkv_kernel", "attention_backward"),
        ("threshold_bwd_dq_kernel", "attention_backward"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention_forward"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention_backward"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention_forward"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x64x128", "attention_backward"),
        ("triton_per_fused__to_copy_native_layer_norm_0", "rest"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "rest"),
    ],
)
def test_kernel_part(name, part):
    assert kernel_part(name) == part


def test_breakdown_sums_gpu_time_per_step_by_part():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        SimpleNamespace(name="threshold_fwd_kernel", device_type=cuda, device_time_total=300.0, is_user_annotation=False),
        SimpleNamespace(name="threshold_bwd_dq_kernel", device_type=cuda, device_time_total=500.0, is_user_annotation=False),
        SimpleNamespace(name="threshold_bwd_dkv_kernel", device_type=cuda, device_time_total=700.0, is_user_annotation=False),
        SimpleNamespace(name="triton_poi_fused_add_0", device_type=cuda, device_time_total=1000.0, is_user_annotation=False),
        # a CPU op (its kernels are listed apart) and the GPU range of an annotation spanning kernels: not counted
        SimpleNamespace(name="aten::mm", device_type=cpu, device_time_total=9999.0, is_user_annotation=False),
        SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda, device_time_total=9999.0, is_user_annotation=True),
    ]
    ms = breakdown(events, steps=2)
    assert ms == pytest.approx(
        {"attention_forward": 0.15, "attention_backward": 0.6, "rest": 0.5, "gpu": 1.25}
    )


@pytest.mark.parametrize(("kwargs", "name"), [({"start": 0}, "start"), ({"steps": 0}, "steps"), ({"start": 2.5}, "start")])
def test_kernel_breakdown_refuses_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KernelBreakdown(**kwargs)


def test_run_summary_and_main(tmp_path, capsys):
    run = tmp_path / "run"
    writer = SummaryWriter(str(run))
    for step, rate in enumerate([100.0, 200.0, 250.0, 125.0, 160.0]):  # 10, 5, 4, 8, 6.25 ms
        writer.add_scalar("train/device/batches_per_sec", rate, step * 100)
    for step, loss in enumerate([2.0, 1.5, 1.6]):
        writer.add_scalar("val/loss", loss, step * 250)
    writer.add_scalar("profile/attention_forward_ms", 0.5, 200)
    writer.close()

    summary = run_summary(run)
    assert summary["ms_per_step"] == pytest.approx(6.25)
    assert summary["windows"] == 5
    assert summary["ms_q1"] < summary["ms_per_step"] < summary["ms_q3"]
    assert summary["best_val_loss"] == pytest.approx(1.5)
    assert summary["attention_forward_ms"] == pytest.approx(0.5)

    main([str(run)])
    table = capsys.readouterr().out
    assert "6.25" in table and "| ms_per_step |" in table


def test_run_summary_without_throughput_names_the_run(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("val/loss", 1.0, 0)
    writer.close()
    with pytest.raises(ValueError, match="batches_per_sec"):
        run_summary(tmp_path)
