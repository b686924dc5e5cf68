"""Every YAML under configs/ parses and trains a few steps on CPU (tiny overrides, nothing downloaded).

Three kinds: whole configs; group pieces in configs/<group>/ (`--data configs/data/mqar.yaml`); and
variant pieces next to a `base.yaml`, trained as `--config <dir>/base.yaml --config <piece>`."""

import random
from pathlib import Path

import pytest
import yaml

from lit_thresh.compare import plan
from lit_thresh.cli import build_cli, main
from lit_thresh.schedule import WarmupCosine

CONFIGS = Path(__file__).parents[1] / "configs"
COMPARES = sorted((CONFIGS / "compare").glob("*.yaml"))  # `lit_thresh compare` configs
BASES = sorted(CONFIGS.rglob("base.yaml"))  # completed by the variant pieces next to them
YAMLS = sorted(set(CONFIGS.rglob("*.yaml")) - set(COMPARES) - set(BASES))
GROUPS = ("trainer", "model", "data")
TINY_TRAINER = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=1",
    "--trainer.max_steps=2",
    "--trainer.limit_train_batches=2",
    "--trainer.val_check_interval=1",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_checkpointing=false",
    "--model.compile=false",  # torch.compile takes ~1 min on a CPU; tests/test_module.py covers it
]

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


def is_piece(path: Path) -> bool:
    """A group piece (`--data configs/data/mqar.yaml`) rather than a whole config."""
    return not set(GROUPS) & set(yaml.safe_load(path.read_text()))


def config_files(path: Path) -> list[Path]:
    """The configs that make the run of `path`: its base.yaml first if it is a variant piece."""
    base = path.parent / "base.yaml"
    return [base, path] if base.is_file() else [path]


def data_class_path(path: Path) -> str:
    data = yaml.safe_load(config_files(path)[0].read_text())["data"]
    if isinstance(data, str):  # a nested piece, relative to the config
        data = yaml.safe_load((path.parent / data).read_text())
    return data["class_path"]


@pytest.fixture
def offline_cpu(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU runs take the PyTorch kernels
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


def tiny_data(path: Path, workdir: Path) -> list[str]:
    """Overrides that shrink the config's data to a few small batches (and a local text file)."""
    class_path = data_class_path(path)
    if class_path.endswith("MQARDataModule"):
        return ["--data.init_args.batch_size=4"]
    if class_path.endswith("TextDataModule"):
        words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
        rng = random.Random(0)
        text = workdir / "input.txt"
        text.write_text("\n".join(" ".join(rng.choices(words, k=12)).capitalize() + "." for _ in range(400)))
        return [
            "--data.init_args.path=text",
            "--data.init_args.name=null",
            f"--data.init_args.data_files={text}",
            "--data.init_args.block_size=32",
            "--data.init_args.batch_size=2",
            "--data.init_args.num_proc=null",
            "--data.init_args.num_workers=0",
            f"--data.init_args.cache_dir={workdir / 'hf_cache'}",
        ]
    raise AssertionError(f"{path}: no tiny overrides for data class {class_path}")


@pytest.mark.parametrize("path", [p for p in YAMLS if not is_piece(p)], ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_trains(path, offline_cpu):
    configs = [arg for config in config_files(path) for arg in ("--config", str(config))]
    args = [*configs, *TINY_TRAINER, *tiny_data(path, offline_cpu)]
    cli = build_cli(["fit", *args])
    assert list(offline_cpu.glob("lightning_logs/**/events.out.tfevents.*"))
    for config in cli.trainer.lr_scheduler_configs:  # the cosine lasts --trainer.max_steps, as run
        if isinstance(config.scheduler, WarmupCosine):
            assert config.scheduler.max_steps == 2
    if data_class_path(path).endswith("MQARDataModule"):
        main(["test", *args])  # the length test sets run past the training length


@pytest.mark.parametrize("path", [p for p in YAMLS if is_piece(p)], ids=lambda p: str(p.relative_to(CONFIGS)))
def test_piece_parses(path, capsys):
    group = path.parent.name
    assert group in GROUPS, f"{path}: a piece lives in configs/<group>/, group one of {GROUPS}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--{group}", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)[group]


def covering_runs(cfg) -> list[plan.Run]:
    """Few runs of a comparison that together hold every variant and every kind of grid value. Numbers and
    booleans parse alike whatever their value (the parser checks their type; ranges are checked when a run
    builds its model), so grid values that differ only in them (the threshold sweeps' settings) count as one
    kind; any other value (strings: Literal choices; lists, dicts) is a kind of its own."""
    overrides = plan.grid_overrides(cfg)

    def kind(value: tuple[str, str]) -> tuple:
        return value[0], frozenset((key, type(v).__name__ if isinstance(v, (int, float)) else repr(v))
                                   for key, v in overrides[value].items())

    runs, seen = [], set()
    for run in plan.expand(cfg):
        new = {run.variant, *map(kind, run.cell)} - seen
        if new:
            runs.append(run)
            seen |= new
    return runs


@pytest.mark.parametrize("path", COMPARES, ids=lambda p: p.name)
def test_compare_config_runs_parse(path, capsys):
    """Every variant and every kind of grid value (covering_runs) makes a valid `lit_thresh fit` configuration."""
    cfg = plan.parse(["--config", str(path)])
    assert cfg.variants and cfg.seeds
    for run in covering_runs(cfg):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", *plan.run_args(cfg, run), "--print_config"])
        assert exit_info.value.code in (0, None), run.name
        printed = yaml.safe_load(capsys.readouterr().out)
        attention = printed["model"]["config"]["attention"]["class_path"]
        kind = run.variant.removesuffix("_sparse")  # shakespeare_char.yaml's threshold_sparse: a setting
        assert attention.lower().endswith(kind.replace("_", "") + "attention"), run.name


def test_zoology_exact_model_is_expressible(offline_cpu):
    """Zoology's MQAR model: learned positions over the data's 256 tokens, no key conv, 2 layers, 1 head, no MLP."""
    overrides = ["--model.config.positional=learned", "--model.config.key_conv=0"]
    args = ["--config", str(CONFIGS / "mqar" / "base.yaml"), *overrides, "--data.init_args.test_length_multipliers=[]"]
    cli = build_cli([*args, *TINY_TRAINER], run=False)  # after_instantiate_classes checks the lengths
    model = cli.model.model
    assert model.pos_emb.num_embeddings == cli.datamodule.max_seq_len == 256
    assert len(model.blocks) == 2
    assert all(block.attn.n_heads == 1 and block.attn.key_conv is None and block.mlp is None for block in model.blocks)
