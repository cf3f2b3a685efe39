"""Run folders and checkpoints of a recipe.

Every run writes into a folder of its own, ``OUT/<UTC timestamp>/`` (a suffix ``-1``,
``-2``, ... if two runs start in the same second); nothing of an earlier run is ever
overwritten. ``--resume RUN`` continues the run in ``RUN`` from its latest checkpoint.

A checkpoint is one ``torch.save`` file, ``RUN/checkpoints/step-NNNNNN.pt``, written to a
temporary name and renamed (a crash mid-write leaves the previous one intact). It holds
plain data only (tensors, numbers, strings, lists, dicts), so it loads with
``weights_only=True`` (an update engine's state may add a few classes of its own, which
:func:`load_checkpoint` is told to allow).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "latest_checkpoint",
    "load_checkpoint",
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
    """Write ``state`` as the checkpoint after ``step`` steps; returns its path."""
    folder = run_dir / _CHECKPOINTS
    folder.mkdir(exist_ok=True)
    path = folder / f"step-{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint with the most steps in ``run_dir``."""
    found = sorted(
        (int(m[1]), p)
        for p in (run_dir / _CHECKPOINTS).glob("step-*.pt")
        if (m := _NAME.fullmatch(p.name))
    )
    if not found:
        raise ConfigError(
            f"--resume {run_dir}: no checkpoint in {run_dir / _CHECKPOINTS} (the run stopped "
            "before its first --checkpoint-every step); start a new run"
        )
    return found[-1][1]


def load_checkpoint(path: Path, *, allowed: Sequence[type] = ()) -> dict[str, Any]:
    """The checkpoint in ``path``; ``allowed``: classes besides plain data it may hold."""
    with torch.serialization.safe_globals(list(allowed)):
        state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or "step" not in state:
        raise ConfigError(f"{path} is not a checkpoint of this recipe")
    return state
