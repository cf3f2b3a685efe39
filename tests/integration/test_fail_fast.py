"""Calls fail fast against a hung controller, and launch_hub names a journal's holder
(issue 26, item 6)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._transport.session import SILENT_WAIT_S
from flowrl.errors import JournalError, TransportError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COLS = [Column.scalar("x", "int64")]
RPC_TIMEOUT_S = 5.0


def test_put_async_fails_fast_once_the_controller_is_known_hung() -> None:
    """Against a SIGSTOPped controller, each put_async past the indices a thread reserved
    ahead used to wait a full rpc_timeout, one after another. Only the first does now;
    the next ones wait SILENT_WAIT_S (and say the controller is presumed gone), and once the
    controller is back, puts are served again."""
    hub = flowrl.launch_hub(COLS, tasks={"train": ["x"]}, config=HubConfig(capacity=4096))
    hub.rpc_timeout = RPC_TIMEOUT_S
    pid = int(hub.servers.procs[-1].pid)
    try:
        hub.put({"x": np.array([0])})  # this thread's pool of indices reserved ahead
        os.kill(pid, signal.SIGSTOP)
        failures: list[TransportError] = []
        k = 1
        while len(failures) < 4:
            try:
                hub.put_async({"x": np.array([k])})
            except TransportError as exc:
                failures.append(exc)
            k += 1
            assert k < 1000, "put_async never noticed the hung controller"
        first, *later = failures
        assert f"within {RPC_TIMEOUT_S:.1f}s" in str(first)
        for exc in later:
            assert f"within {SILENT_WAIT_S:.1f}s" in str(exc), str(exc)
            assert "presumed gone" in str(exc)
        os.kill(pid, signal.SIGCONT)
        hub.put({"x": np.array([-1])})  # heard again: served as before
        hub.flush()  # (the puts on indices reserved ahead were answered once it woke)
        assert hub.statistics().tasks["train"].ready == 1 + (k - 1 - len(failures)) + 1
    finally:
        os.kill(pid, signal.SIGCONT)
        hub.close()


def test_launch_hub_on_a_journal_held_by_another_process_names_the_holder(
    tmp_path: Path,
) -> None:
    config = HubConfig(capacity=64, journal=JournalConfig(path=str(tmp_path / "j")))
    first = flowrl.launch_hub(COLS, config=config)
    try:
        holder = first.servers.procs[-1].pid
        with pytest.raises(JournalError, match=f"in use by process {holder}"):
            flowrl.launch_hub(COLS, config=config)
        first.put({"x": np.array([1])})  # the first hub is unharmed
    finally:
        first.close()
