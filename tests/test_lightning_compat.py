"""Every private Lightning name lit_thresh uses (lit_thresh.lightning_compat) still exists in the installed
Lightning: a release that drops or renames one fails here, naming it, rather than deep inside a run."""

import ast
import importlib
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ThroughputMonitor

from lit_thresh import lightning_compat
from lit_thresh.cli import build_cli

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")


@pytest.fixture(scope="module")
def instances() -> dict[str, object]:
    """One object of each owner class, for the names Lightning sets on instances (in __init__)."""
    cli = build_cli(["--data", "lit_thresh.data.MQARDataModule", "--trainer.accelerator", "cpu"], run=False)
    trainer = cli.trainer
    objects = [cli, cli.parser, trainer, trainer._signal_connector, trainer._logger_connector]
    objects.append(trainer.fit_loop.epoch_loop)
    objects += [ThroughputMonitor(batch_size_fn=len), *trainer.checkpoint_callbacks]
    return {f"{type(o).__module__}.{type(o).__qualname__}": o for o in objects}


def owner_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("owner,name", lightning_compat.PRIVATE_NAMES, ids="{0[1]}".format)
def test_private_lightning_name_exists(instances, owner, name):
    cls = owner_class(owner)
    found = hasattr(cls, name) or any(isinstance(o, cls) and hasattr(o, name) for o in instances.values())
    assert found, (
        f"{owner}.{name} is gone from the installed version: update lit_thresh/lightning_compat.py (and "
        "the `lightning` bound in pyproject.toml) to this version's equivalent"
    )


def test_private_lightning_names_are_used_in_lightning_compat_only():
    """No other module of the package defines, reads or names (getattr) a private name of PRIVATE_NAMES, so
    the test above covers every one. (Those without a leading underscore are public names elsewhere.)"""
    private = {name for _, name in lightning_compat.PRIVATE_NAMES if name.startswith("_")}
    package = Path(lightning_compat.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(lightning_compat.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            else:
                continue
            if name in private:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno} {name}")
    assert not found, f"private Lightning names outside lit_thresh/lightning_compat.py: {found}"


def test_should_update_logs_follows_log_every_n_steps(instances):
    """The wrapper reads Lightning's own answer; outside a loop Lightning says True, and never with 0."""
    trainer = next(o for o in instances.values() if type(o).__name__ == "Trainer")
    assert lightning_compat.should_update_logs(trainer) is True
    trainer.log_every_n_steps = 0
    assert lightning_compat.should_update_logs(trainer) is False
