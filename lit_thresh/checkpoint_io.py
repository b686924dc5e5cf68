"""Checkpoint files that are complete or absent: written beside their target, synced, then renamed over it."""

import os
import uuid
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

TMP_SUFFIX = ".tmp"


def temporary_files(target: Path) -> list[Path]:
    """The temporary files that saves of ``target`` left behind when they were killed."""
    return sorted(target.parent.glob(f".{target.name}.*{TMP_SUFFIX}"))


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose local saves never leave a half-written checkpoint.

    A checkpoint is written to a hidden file beside its target (``.last.ckpt.<random>.tmp``), flushed and
    fsynced, then ``os.replace``-d over the target (atomic on POSIX), and the folder is fsynced so that the
    rename survives a power cut. A kill during a save leaves the previous checkpoint as it was and, at
    worst, a temporary file; the next save of the same target removes it, and ``ckpt_path="last"`` never
    picks it (its name does not end in ``.ckpt``). (Lightning's own TorchCheckpointIO writes through an
    fsspec transaction whose temporary file sits in the system's temp folder: moving it into place is a
    copy when that folder is on another file system, and nothing is fsynced.) Remote paths and
    ``storage_options`` go to TorchCheckpointIO unchanged.

    Loads read tensors and plain data only (``weights_only=True`` unless a caller asks otherwise): a
    checkpoint whose pickle would run code is refused, also a remote one (Lightning's default for those
    is ``weights_only=False``).
    """

    def load_checkpoint(
        self, path: _PATH, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location, weights_only=True if weights_only is None else weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in temporary_files(target):
            stale.unlink(missing_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            with open(tmp, "xb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
