"""A run's configuration as compare records it: what decides whether a run on disk is the run asked for.

Each argument of a run (``plan.run_args``) is a part: a ``--config`` file by the sha256 of its parsed
contents, with the YAML files it names in their place (``data: ../data/mqar.yaml``), any other argument as
written. The hash of the parts, not of the paths, decides: editing a config file changes the runs made from
it; editing its comments or layout, or moving it, does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

YAML_SUFFIXES = (".yaml", ".yml")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _inline(tree: Any, folder: Path, seen: frozenset[Path]) -> Any:
    """tree with each string that names a YAML file (relative to folder, as jsonargparse reads it)
    replaced by that file's contents."""
    if isinstance(tree, dict):
        return {key: _inline(value, folder, seen) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_inline(value, folder, seen) for value in tree]
    if isinstance(tree, str) and tree.endswith(YAML_SUFFIXES):
        nested = (folder / tree).resolve()
        if nested.is_file() and nested not in seen:
            return config_contents(nested, seen)
    return tree


def config_contents(path: Path, seen: frozenset[Path] = frozenset()) -> Any:
    """The parsed contents of the YAML config at path, the YAML files it names inlined; ValueError naming
    the file when it cannot be read."""
    path = Path(path).resolve()
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: cannot read this config: {error}") from None
    return _inline(tree, path.parent, seen | {path})


def _config_paths(args: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """(argument, config path or None) for each argument; ``--config PATH`` counts as one."""
    tokens = iter(args)
    for arg in tokens:
        if arg == "--config":
            path = next(tokens, None)
            yield f"--config {path}", path
        elif arg.startswith("--config="):
            yield arg, arg.removeprefix("--config=")
        else:
            yield arg, None


def fingerprint(args: Sequence[str]) -> list[dict[str, str]]:
    """A run's arguments as parts: ``{"config": PATH, "sha256": ...}`` for a config file (its parsed
    contents), ``{"arg": ARG}`` for any other argument."""
    parts = []
    for arg, path in _config_paths(args):
        if path is None:
            parts.append({"arg": arg})
        else:
            contents = json.dumps(config_contents(Path(path)), sort_keys=True, default=str)
            parts.append({"config": path, "sha256": _sha256(contents)})
    return parts


def config_hash(parts: Sequence[dict[str, str]]) -> str:
    """The hash of a run's parts: config contents and other arguments, in order (not the configs' paths)."""
    keys = [f"config:{part['sha256']}" if "sha256" in part else f"arg:{part['arg']}" for part in parts]
    return _sha256(json.dumps(keys))


def describe_change(old: Sequence[dict[str, str]], new: Sequence[dict[str, str]]) -> str:
    """What differs between two runs' parts, in words (the first few differences)."""
    old_configs = {part["config"]: part["sha256"] for part in old if "config" in part}
    new_configs = {part["config"]: part["sha256"] for part in new if "config" in part}
    changes = [f"the contents of {path} changed" for path, digest in new_configs.items()
               if path in old_configs and old_configs[path] != digest]
    old_args, new_args = [p.get("arg", p.get("config")) for p in old], [p.get("arg", p.get("config")) for p in new]
    removed = [arg for arg in old_args if arg not in new_args]
    added = [arg for arg in new_args if arg not in old_args]
    if removed:
        changes.append(f"no longer given: {', '.join(removed[:3])}" + (" ..." if len(removed) > 3 else ""))
    if added:
        changes.append(f"newly given: {', '.join(added[:3])}" + (" ..." if len(added) > 3 else ""))
    return "; ".join(changes) or "its arguments' order changed"
