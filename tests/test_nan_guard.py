"""NaNGuard in the ``lit_thresh`` command: a NaN loss or an infinite gradient stops training with an error
naming the step, before the optimizer step (or, deferred as on CUDA, at the next step or the next save),
and the last checkpoint keeps the finite weights before it."""

import math

import pytest
import torch

from lit_thresh.cli import main
from lit_thresh.module import LanguageModel

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

BAD_STEP = 4  # steps 0-3 train normally; step 4 goes wrong, after the step-4 checkpoint
# A tiny MQAR fit (8 steps, softmax attention, last.ckpt every 2 steps).
TINY = """
trainer:
  accelerator: cpu
  max_epochs: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger: {init_args: {name: nan}}
diagnostics: {enabled: false}
model: {config: {d_model: 16, n_layers: 1, mlp_ratio: 0}}
data:
  class_path: lit_thresh.data.MQARDataModule
  init_args:
    vocab_size: 32
    train: [{seq_len: 16, num_kv_pairs: 2, num_examples: 64}]
    val: [{seq_len: 16, num_kv_pairs: 2, num_examples: 16}]
    test_length_multipliers: []
    batch_size: 8
"""


def poison(monkeypatch, what: str, bad_step: int = BAD_STEP) -> list[LanguageModel]:
    """Makes the loss (NaN) or the first parameter's gradient (inf) of training step bad_step non-finite;
    returns a list that will hold the model."""
    models = []
    forward, on_after_backward = LanguageModel.forward, LanguageModel.on_after_backward

    def bad_forward(self: LanguageModel, idx: torch.Tensor) -> torch.Tensor:
        models[:] = [self]
        logits = forward(self, idx)  # (B, T, V)
        bad = what == "loss" and self.training and self.trainer.global_step == bad_step
        return logits * math.nan if bad else logits

    def bad_gradient(self: LanguageModel) -> None:
        on_after_backward(self)
        if what == "gradient" and self.trainer.global_step == bad_step:
            next(self.parameters()).grad.view(-1)[int(torch.randint(8, ()))] = math.inf

    monkeypatch.setattr(LanguageModel, "forward", bad_forward)
    monkeypatch.setattr(LanguageModel, "on_after_backward", bad_gradient)
    return models


@pytest.mark.parametrize("what", ["loss", "gradient"])
@pytest.mark.parametrize(
    "deferred,every_n_steps,accelerator",
    [
        (False, 2, "cpu"),
        (True, 2, "cpu"),  # read at the next step
        (True, 1, "cpu"),  # read at the save right after the bad step
        pytest.param(None, 2, "gpu", marks=pytest.mark.gpu),  # the default on CUDA: deferred, via pinned memory
    ],
    ids=["immediate", "deferred-next-step", "deferred-next-save", "cuda-default"],
)
def test_non_finite_step_stops_without_a_later_checkpoint(
    tmp_path, monkeypatch, what, deferred, every_n_steps, accelerator
):
    models = poison(monkeypatch, what)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    seed = str(int(torch.randint(10_000, ())))
    options = [f"--step_checkpoint.every_n_train_steps={every_n_steps}", f"--trainer.accelerator={accelerator}"]
    options += [] if deferred is None else [f"--nan_guard.init_args.deferred={str(deferred).lower()}"]
    with pytest.raises(SystemExit) as error:  # the command's one-line error, no traceback
        main(["fit", "--config", "tiny.yaml", "--seed_everything", seed, *options])
    deferred = accelerator == "gpu" if deferred is None else deferred

    message = str(error.value.code)
    assert message.startswith("lit_thresh: error: non-finite") and "\n" not in message
    assert f"at global step {BAD_STEP} (epoch 0, batch {BAD_STEP})" in message
    if deferred:
        assert "no checkpoint was written after this step" in message
    else:
        assert "stopped before this optimizer step" in message
    assert "the last checkpoint, lightning_logs/nan/version_0/checkpoints/last.ckpt, " in message
    if what == "loss":
        assert "non-finite training loss nan" in message
    else:
        first = next(name for name, _ in models[0].named_parameters())
        assert f"non-finite gradients of {first} " in message and "(loss " in message

    checkpoints = tmp_path / "lightning_logs/nan/version_0/checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]  # nothing written at or after the bad step
    checkpoint = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == BAD_STEP
    weights = checkpoint["state_dict"]
    assert all(value.isfinite().all() for value in weights.values())
    if deferred:  # the bad step updated the weights in memory, but they were never saved
        assert not all(value.isfinite().all() for value in models[0].state_dict().values())
        return
    for name, value in models[0].state_dict().items():  # the bad step changed nothing: model == checkpoint
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "deferred,says", [(True, "no checkpoint was written after this step, nor before it"), (False, "(no checkpoint")]
)
def test_a_bad_last_step_is_reported_at_the_end_of_training(tmp_path, monkeypatch, deferred, says):
    """Without checkpoints: deferred, the check of the last step is read when training ends; the message
    does not speak of a last checkpoint."""
    poison(monkeypatch, "loss", bad_step=7)  # the last of the 8 steps
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    with pytest.raises(SystemExit) as error:
        options = ["--trainer.enable_checkpointing=false", f"--nan_guard.init_args.deferred={str(deferred).lower()}"]
        main(["fit", "--config", "tiny.yaml", *options])
    message = str(error.value.code)
    assert "non-finite training loss nan at global step 7 (epoch 0, batch 7)" in message
    assert says in message and "last checkpoint" not in message


def test_deferred_check_refuses_weights_only_checkpoints(tmp_path, monkeypatch):
    """Lightning skips callbacks' on_save_checkpoint for weights-only checkpoints, so a deferred check
    could not stop such a save: deferred=True is refused with them (the default then reads at once)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    with pytest.raises(SystemExit) as error:
        options = ["--checkpoint.save_weights_only=true", "--nan_guard.init_args.deferred=true"]
        main(["fit", "--config", "tiny.yaml", *options])
    assert "save_weights_only" in str(error.value.code) and "deferred" in str(error.value.code)
