"""Recipe checkpoints are durable and checksummed; resume skips a torn newest one."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.recipes.checkpoint import load_latest_checkpoint, save_checkpoint


def _state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((64, 64), float(step))}}


def _save(run_dir: Path, *steps: int) -> list[Path]:
    return [save_checkpoint(run_dir, step, _state(step)) for step in steps]


def _truncate(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def test_resume_skips_a_truncated_newest_checkpoint(tmp_path: Path, caplog) -> None:
    _, newest = _save(tmp_path, 2, 4)
    _truncate(newest)
    with caplog.at_level(logging.WARNING, logger="flowrl.recipes"):
        state = load_latest_checkpoint(tmp_path)
    assert state["step"] == 2 and torch.equal(state["model"]["w"], _state(2)["model"]["w"])
    [warning] = caplog.records
    assert str(newest) in warning.getMessage() and "\n" not in warning.getMessage()


def test_a_flipped_byte_fails_the_checksum(tmp_path: Path, caplog) -> None:
    _, newest = _save(tmp_path, 1, 2)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size; torch.load alone might not notice
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="flowrl.recipes"):
        assert load_latest_checkpoint(tmp_path)["step"] == 1
    assert "do not match its checksum" in caplog.text


def test_checkpoints_from_before_checksums_still_load(tmp_path: Path) -> None:
    old, newest = _save(tmp_path, 1, 2)
    for path in (old, newest):
        path.with_name(path.name + ".sha256").unlink()
    assert load_latest_checkpoint(tmp_path)["step"] == 2
    _truncate(newest)  # torch.load is then the only check, and it notices
    assert load_latest_checkpoint(tmp_path)["step"] == 1


def test_every_checkpoint_torn_is_a_config_error(tmp_path: Path) -> None:
    for path in _save(tmp_path, 1, 2):
        _truncate(path)
    with pytest.raises(ConfigError, match=r"every checkpoint in .* is torn"):
        load_latest_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="no checkpoint in"):
        load_latest_checkpoint(tmp_path / "elsewhere")


def test_save_fsyncs_the_file_then_the_folder(tmp_path: Path, monkeypatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    _save(tmp_path, 1)
    monkeypatch.setattr(os, "fsync", fsync)
    _save(tmp_path, 2)
    # the checkpoint, its checksum, then the folder holding both renames
    assert synced == ["file", "file", "folder"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000001.pt",
        "step-000001.pt.sha256",
        "step-000002.pt",
        "step-000002.pt.sha256",
    ]
