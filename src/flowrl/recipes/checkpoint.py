"""Run folders and checkpoints of a recipe.

Every run writes into a folder of its own, ``OUT/<UTC timestamp>/`` (a suffix ``-1``,
``-2``, ... if two runs start in the same second); nothing of an earlier run is ever
overwritten. ``--resume RUN`` continues the run in ``RUN`` from its latest checkpoint.

A checkpoint is one ``torch.save`` file, ``RUN/checkpoints/step-NNNNNN.pt``, and its
checksum beside it, ``step-NNNNNN.pt.sha256`` (JSON: ``sha256`` and ``bytes``). Each is
written to a temporary name, fsynced, and renamed, the checksum first; then the folder is
fsynced, so a crash or power loss leaves either the whole new checkpoint or the previous
ones. :func:`load_latest_checkpoint` takes the newest checkpoint whose bytes match its
checksum and skips a torn one with a warning (a checkpoint written before checksums existed
counts as torn when ``torch.load`` fails on it). A checkpoint holds plain data only
(tensors, numbers, strings, lists, dicts), so it loads with ``weights_only=True`` (an update
engine's state may add a few classes of its own, which the loader is told to allow).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.recipes.progress import log

__all__ = [
    "CONFIG_FILE",
    "checkpoints",
    "load_latest_checkpoint",
    "new_run_dir",
    "read_config",
    "save_checkpoint",
    "write_config",
]

CONFIG_FILE = "config.json"
_CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"step-(\d+)\.pt")


def new_run_dir(parent: str | os.PathLike[str]) -> Path:
    """Create and return a fresh ``parent/<UTC timestamp>`` folder (never an existing one)."""
    base = Path(parent)
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"{base}: 1000 runs started in the second {stamp}; pick another --out")


def write_config(run_dir: Path, config: msgspec.Struct) -> None:
    (run_dir / CONFIG_FILE).write_text(json.dumps(msgspec.to_builtins(config), indent=2) + "\n")


def read_config(run_dir: Path) -> dict[str, Any]:
    """The config a run was started with (``RUN/config.json``), as a dict."""
    path = run_dir / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--resume {run_dir}: no {CONFIG_FILE} there; pass the folder of a run (the "
            "OUT/<timestamp> folder it printed as run_dir)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--resume {run_dir}: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--resume {run_dir}: {path} holds {type(config).__name__}, not a dict")
    return config


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as the checkpoint after ``step`` steps, durably; returns its path."""
    folder = run_dir / _CHECKPOINTS
    if not folder.is_dir():
        folder.mkdir()
        _fsync_folder(run_dir)
    path = folder / f"step-{step:06d}.pt"
    tmp = _write_synced(path, lambda f: torch.save(state, f))
    checksum, sums = json.dumps(_checksum(tmp)).encode(), _checksum_path(path)
    os.replace(_write_synced(sums, lambda f: f.write(checksum)), sums)
    os.replace(tmp, path)  # after the checksum that vouches for it
    _fsync_folder(folder)
    return path


def checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoint files in ``run_dir``, newest (most steps) first."""
    found = sorted(
        (
            (int(m[1]), p)
            for p in (run_dir / _CHECKPOINTS).glob("step-*.pt")
            if (m := _NAME.fullmatch(p.name))
        ),
        reverse=True,
    )
    return [p for _, p in found]


def load_latest_checkpoint(run_dir: Path, *, allowed: Sequence[type] = ()) -> dict[str, Any]:
    """The newest intact checkpoint in ``run_dir``; a torn newer one is skipped with a
    warning. ``allowed``: classes besides plain data a checkpoint may hold."""
    found = checkpoints(run_dir)
    if not found:
        raise ConfigError(
            f"--resume {run_dir}: no checkpoint in {run_dir / _CHECKPOINTS} (the run stopped "
            "before its first --checkpoint-every step); start a new run"
        )
    for path in found:
        state, why = _load_intact(path, allowed)
        if state is not None:
            return state
        log.warning("skipping torn checkpoint %s (%s); trying the one before", path, why)
    raise ConfigError(
        f"--resume {run_dir}: every checkpoint in {run_dir / _CHECKPOINTS} is torn (see the "
        "warnings above); start a new run"
    )


def _load_intact(path: Path, allowed: Sequence[type]) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint in ``path``, or None and why it is torn."""
    try:
        want = json.loads(_checksum_path(path).read_bytes())
    except FileNotFoundError:
        want = None  # written before checksums: torch.load is the only check
    except ValueError:
        return None, "its checksum file is unreadable"
    if want is not None and _checksum(path) != want:
        return None, "its bytes do not match its checksum"
    try:
        with torch.serialization.safe_globals(list(allowed)):
            state = torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
        if want is not None:
            raise  # intact bytes: a real error (a class not allowed), not a torn write
        return None, f"torch.load failed: {exc}".splitlines()[0]
    if not isinstance(state, dict) or "step" not in state:
        raise ConfigError(f"{path} is not a checkpoint of this recipe")
    return state, ""


def _checksum(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_synced(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """``path``'s content written by ``write`` to a temporary file on disk; returns that."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
