"""LanguageModel: training, metric names and values, optimizer groups, schedule, configuration from YAML.

Threshold variants train in float64 ("64-true"): threshold attention then takes its PyTorch path on CPU.
"""

from __future__ import annotations

import csv
import functools
import math

import lightning as L
import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from lit_thresh.attention import DiffSoftmaxAttention, DiffThresholdAttention, SoftmaxAttention, ThresholdAttention
from lit_thresh.data import MQARDataModule, MQARSetting
from lit_thresh.metrics import IGNORE_INDEX
from lit_thresh.model import TransformerConfig
from lit_thresh.module import LanguageModel
from lit_thresh.schedule import WarmupCosine

VOCAB, SEQ = 11, 12


def batches(n: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences counting up modulo VOCAB from a random start: learnable in a few steps."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (starts + torch.arange(SEQ + 1)) % VOCAB  # (n, SEQ + 1)
    labels = ids[:, 1:].clone()
    labels[:, :2] = IGNORE_INDEX  # unsupervised positions
    return [{"input_ids": x, "labels": y} for x, y in zip(ids[:, :-1], labels, strict=True)]


class TinyData(L.LightningDataModule):
    """Two validation and two test sets, named."""

    vocab_size, max_seq_len = VOCAB, SEQ
    val_set_names = test_set_names = ("main", "shifted")

    def train_dataloader(self):
        return DataLoader(batches(), batch_size=4)

    def val_dataloader(self):
        return [DataLoader(batches(seed=1), batch_size=4), DataLoader(batches(seed=2), batch_size=4)]

    test_dataloader = val_dataloader


def trainer(tmp_path, **kwargs) -> L.Trainer:
    config = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    return L.Trainer(**(config | kwargs))


def model(compile=False, optimizer=torch.optim.AdamW, lr_scheduler=WarmupCosine, **config) -> LanguageModel:
    """A small LanguageModel; `config`: TransformerConfig fields over the defaults here."""
    torch.manual_seed(0)
    config = TransformerConfig(**(dict(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, max_seq_len=SEQ) | config))
    return LanguageModel(config, compile=compile, optimizer=optimizer, lr_scheduler=lr_scheduler)


def loss_on(module: LanguageModel, data: list[dict[str, torch.Tensor]]) -> float:
    batch = torch.utils.data.default_collate(data)
    with torch.no_grad():
        logits = module(batch["input_ids"].to(module.device))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten().to(module.device)).item()


@pytest.mark.parametrize(
    "attention,precision",
    [(SoftmaxAttention, "32-true")]
    + [
        (cls, "64-true") for cls in (SoftmaxAttention, ThresholdAttention, DiffThresholdAttention, DiffSoftmaxAttention)
    ],
)
def test_training_decreases_the_loss(tmp_path, attention, precision):
    module = model(attention=attention, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), lr_scheduler=None)
    before = loss_on(module.to(torch.float64 if precision == "64-true" else torch.float32), batches())
    trainer(tmp_path, max_steps=15, precision=precision, limit_val_batches=0).fit(
        module, DataLoader(batches(), batch_size=4)
    )
    assert loss_on(module, batches()) < 0.8 * before


def test_training_metrics_are_token_means_since_the_last_write(tmp_path):
    """train/loss is logged on the steps the logger writes (every log_every_n_steps) and on the epoch's
    last batch (for callbacks that read it at the end of the epoch), as the token-weighted mean loss of
    all batches since the previous one; lr 0 keeps the weights, so the losses can be recomputed."""
    data = batches(n=20)
    for i, sample in enumerate(data):  # unequal numbers of supervised tokens per batch
        sample["labels"][2 : 2 + i % 5] = IGNORE_INDEX
    module = model(optimizer=functools.partial(torch.optim.SGD, lr=0.0), lr_scheduler=None)
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="csv")
    fit = trainer(tmp_path, max_epochs=1, log_every_n_steps=3, logger=logger)
    fit.fit(module, DataLoader(data, batch_size=2))

    rows = [row for row in csv.DictReader(open(logger.log_dir + "/metrics.csv")) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == [2, 5, 8]  # batches 0-2, 3-5, 6-8
    logged = [float(row["train/loss"]) for row in rows] + [fit.callback_metrics["train/loss"].item()]  # + batch 9
    for value, first, last in zip(logged, (0, 3, 6, 9), (2, 5, 8, 9), strict=True):
        window = torch.utils.data.default_collate(data[2 * first : 2 * last + 2])
        with torch.no_grad():
            logits = module(window["input_ids"])  # (B, T, V)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window["labels"].flatten())
        assert abs(value - expected.item()) < 1e-5


def test_metric_names_per_split_and_set(tmp_path):
    module, data = model(), TinyData()
    fit = trainer(tmp_path, max_steps=2, log_every_n_steps=1)
    fit.fit(module, data)
    sets = ["val", "val/shifted"]
    expected = {"train/loss", "train/acc", "n_params"} | {f"{s}/{m}" for s in sets for m in ("loss", "acc", "ppl")}
    assert set(fit.logged_metrics) == expected
    assert fit.logged_metrics["n_params"] == sum(p.numel() for p in module.parameters())
    test = trainer(tmp_path)
    test.test(module, data)
    assert set(test.logged_metrics) == {f"{s}/{m}" for s in ("test", "test/shifted") for m in ("loss", "acc", "ppl")}


def test_metric_values(tmp_path):
    module, data = model(), batches(seed=3)
    logged = trainer(tmp_path).validate(module, DataLoader(data, batch_size=3))[0]  # batches of unequal size
    batch = torch.utils.data.default_collate(data)
    with torch.no_grad():
        logits = module(batch["input_ids"])
    supervised = batch["labels"] != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[supervised], batch["labels"][supervised])
    acc = (logits.argmax(-1)[supervised] == batch["labels"][supervised]).float().mean()
    assert logged["val/loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["val/ppl"] == pytest.approx(math.exp(loss.item()), rel=1e-5)
    assert logged["val/acc"] == pytest.approx(acc.item())


def test_unnamed_extra_validation_loaders_are_rejected(tmp_path):
    loaders = [DataLoader(batches(), batch_size=4)] * 2
    with pytest.raises(ValueError, match="val_set_names"):
        trainer(tmp_path).validate(model(), loaders)


def test_optimizer_decays_only_matrices_and_the_schedule_steps_per_step(tmp_path):
    module = model(attention=ThresholdAttention, optimizer=functools.partial(torch.optim.AdamW, weight_decay=0.1))
    fit = trainer(tmp_path, max_steps=7, limit_val_batches=0, precision="64-true")
    fit.fit(module, DataLoader(batches(), batch_size=4))
    decay, no_decay = fit.optimizers[0].param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    names = {id(p): n for n, p in module.named_parameters()}
    assert any(names[id(p)].endswith("threshold.beta") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    config = fit.lr_scheduler_configs[0]
    assert config.interval == "step" and isinstance(config.scheduler, WarmupCosine)
    assert config.scheduler.max_steps == 7  # from trainer.estimated_stepping_batches
    assert config.scheduler.last_epoch == 7


def test_warmup_cosine_values():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = WarmupCosine(optimizer, warmup_steps=100, max_steps=5000, min_lr_ratio=0.1)
    lr = {}
    for step in range(6001):
        lr[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
    assert lr[0] == pytest.approx(1e-3 / 101)
    assert lr[99] == pytest.approx(1e-3 * 100 / 101)
    assert lr[100] == pytest.approx(1e-3)
    assert lr[2550] == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr[5000] == pytest.approx(1e-4) and lr[6000] == pytest.approx(1e-4)
    assert all(lr[s + 1] <= lr[s] for s in range(100, 6000))


def test_warmup_cosine_without_max_steps_is_flat_and_state_round_trips():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupCosine(optimizer, warmup_steps=0)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == 1.0
    schedule.max_steps = 20
    restored = WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup_steps=0)
    restored.load_state_dict(schedule.state_dict())
    assert restored.max_steps == 20 and restored.lr_factor(20) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 10, "max_steps": 5}, "max_steps"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
    ],
)
def test_warmup_cosine_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **kwargs)


ATTENTION_YAML = {
    SoftmaxAttention: {},
    ThresholdAttention: {
        "beta": 0.5,
        "learn_beta": False,
        "power": 1.5,
        "qk_norm": True,
        "out_norm": False,
        "scale": 2.0,
    },
    DiffThresholdAttention: {"beta": 0.5, "power": 1.0},
    DiffSoftmaxAttention: {"scale": 0.25},
}


@pytest.mark.parametrize("cls", list(ATTENTION_YAML))
@pytest.mark.parametrize("class_path", ["full", "short"])
def test_attention_from_yaml(cls, class_path):
    parser = ArgumentParser()
    parser.add_class_arguments(LanguageModel, "model")
    path = f"lit_thresh.attention.{cls.__name__}" if class_path == "full" else cls.__name__
    config = {
        "vocab_size": VOCAB,
        "d_model": 32,
        "n_heads": 4,
        "n_kv_heads": 2,
        "attention": {"class_path": path, "init_args": ATTENTION_YAML[cls]},
    }
    module = parser.instantiate(parser.parse_string(yaml.safe_dump({"model": {"config": config}}))).model
    attn, expected = module.model.blocks[1].attn, cls(32, 4, 1, n_kv_heads=2, **ATTENTION_YAML[cls])
    assert type(attn) is cls and repr(attn) == repr(expected)  # extra_repr shows the variant kwargs
    if hasattr(expected, "threshold"):
        torch.testing.assert_close(attn.threshold.beta, expected.threshold.beta)


def test_lightning_cli_fit_then_reload_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lit_thresh"])
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "config": {
                        "vocab_size": VOCAB,
                        "d_model": 32,
                        "n_heads": 2,
                        "attention": {"class_path": "DiffThresholdAttention", "init_args": {"beta": 0.5}},
                    },
                    "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}},
                    "lr_scheduler": {
                        "class_path": "lit_thresh.schedule.WarmupCosine",
                        "init_args": {"warmup_steps": 1},
                    },
                },
                "trainer": {
                    "max_steps": 2,
                    "precision": "64-true",
                    "logger": False,
                    "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path),
                },
            }
        )
    )
    cli = LightningCLI(
        LanguageModel, TinyData, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True}
    )
    assert isinstance(cli.model.model.blocks[0].attn, DiffThresholdAttention)
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    reloaded = LanguageModel.load_from_checkpoint(checkpoint)  # rebuilt from the saved config
    assert isinstance(reloaded.model.blocks[0].attn, DiffThresholdAttention)
    assert reloaded.model.blocks[0].attn.threshold.beta.shape == (2,)


def test_generate_uses_the_model():
    module = model().eval()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(module.generate(prompt, 4, temperature=0), module.model.generate(prompt, 4, temperature=0))


def tiny_mqar(**kwargs) -> MQARDataModule:
    settings = dict(
        vocab_size=32,
        train=[MQARSetting(16, 2, 32)],
        val=[MQARSetting(16, 2, 8)],
        test_length_multipliers=[2, 4],
        test_examples=4,
        batch_size=8,
    )
    return MQARDataModule(**(settings | kwargs))


def test_fit_then_test_logs_every_length_test_set(tmp_path):
    data = tiny_mqar()
    module = model(vocab_size=32, max_seq_len=data.max_seq_len, positional="none", key_conv=2)
    run = trainer(tmp_path, max_steps=2, limit_val_batches=1)
    run.fit(module, data)
    run.test(module, data)
    names = ["", "/len32_n2", "/len32_n4", "/len64_n2", "/len64_n8"]
    assert data.test_set_names[1:] == [name[1:] for name in names[1:]]
    assert {f"test{name}/{m}" for name in names for m in ("loss", "acc", "ppl")} <= set(run.callback_metrics)


@pytest.mark.parametrize("stage", ["fit", "test"])
def test_learned_positions_refuse_longer_test_sets(tmp_path, stage):
    data = tiny_mqar()
    module = model(vocab_size=32, max_seq_len=data.max_seq_len, positional="learned")
    message = (
        r"positional='learned' cannot evaluate sequences of 64 tokens after training on 16: learned absolute "
        r"positions cannot extrapolate .* --model.config.positional rope or none, or set the data's "
        r"test_length_multipliers"
    )
    with pytest.raises(ValueError, match=message):
        getattr(trainer(tmp_path, max_steps=1), stage)(module, data)
    trainer(tmp_path, max_steps=1, limit_val_batches=1).fit(module, tiny_mqar(test_length_multipliers=[]))


def test_compile_keeps_outputs_and_checkpoint_keys(tmp_path):
    """compile=True runs torch.compile on the Transformer in place: same logits, same state_dict keys,
    and a fit step trains through the compiled model."""
    torch._dynamo.reset()
    eager, compiled = model(norm="layernorm"), model(norm="layernorm", compile=True)
    compiled.load_state_dict(eager.state_dict())
    trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(compiled, train_dataloaders=TinyData().train_dataloader())
    assert compiled.model._compiled_call_impl is not None
    assert list(compiled.state_dict()) == list(eager.state_dict())
    compiled.load_state_dict(eager.state_dict())  # back to the same weights
    data = batches(seed=3)
    assert abs(loss_on(compiled.eval(), data) - loss_on(eager.eval(), data)) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("compile,mode", [(True, None), ("reduce-overhead", "reduce-overhead")])
def test_compile_mode_goes_to_torch_compile(monkeypatch, compile, mode):
    module = model(compile=compile)
    seen = {}
    monkeypatch.setattr(module.model, "compile", lambda **kwargs: seen.update(kwargs))
    module.configure_model()
    assert seen == {"mode": mode}
    with pytest.raises(ValueError, match="compile must be true, false or one of"):
        model(compile="fast")


def test_compiled_model_runs_other_lengths_and_generation_eagerly():
    """Under compile, the training length runs compiled; another length (a length test set) and KV-cache
    generation run eagerly instead of compiling once more."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    module = model(compile=True)
    counter = CompileCounter()
    module.model.compile(backend=counter)  # what configure_model does, with a counting backend
    module.train_seq_len = SEQ  # as setup sets it from the DataModule
    short = {name: t[: SEQ // 2] for name, t in batches()[0].items()}  # (SEQ // 2,) each
    module._step({k: v.unsqueeze(0) for k, v in short.items()}, module.train_metrics)
    list(module.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4))
    assert counter.frame_count == 0
    module._step({k: v.unsqueeze(0) for k, v in batches()[0].items()}, module.train_metrics)
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("norm,cls", [("rmsnorm", torch.nn.RMSNorm), ("layernorm", torch.nn.LayerNorm)])
def test_norm_choice(norm, cls):
    module = model(norm=norm)
    norms = [m for m in module.modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)) and m.weight.numel() == 32]
    assert norms and all(type(m) is cls for m in norms)
    assert all(getattr(m, "bias", None) is None for m in norms)  # bias-free, as nanoGPT
    with pytest.raises(ValueError, match="norm must be one of"):
        model(norm="batchnorm")


class GradNorms(L.Callback):
    """Records the total gradient norm as the last optimizer step left it (after any clipping): Lightning
    zeroes the gradients at the start of each step, so the first record (no gradients yet) is skipped."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step > 0:
            self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]).item())


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fused_adamw_gradients_are_clipped(tmp_path, precision):
    """Lightning refuses to clip for a fused AdamW under mixed precision (it unscales a GradScaler's
    gradients itself); without a GradScaler the module clips anyway, by Lightning's own clipping.
    (32-true: Lightning clips it itself; the case guards that path.)"""
    clip = 1e-3
    fused = functools.partial(torch.optim.AdamW, fused=True)
    norms = {}
    for clip_val in (None, clip):
        callback = GradNorms()
        run = trainer(tmp_path, max_steps=3, limit_val_batches=0, precision=precision, gradient_clip_val=clip_val)
        run.callbacks.append(callback)
        run.fit(model(optimizer=fused), train_dataloaders=TinyData().train_dataloader())
        norms[clip_val] = callback.norms
    assert len(norms[clip]) == 2 and all(norm > 10 * clip for norm in norms[None])
    assert all(norm == pytest.approx(clip, rel=1e-3) for norm in norms[clip])
