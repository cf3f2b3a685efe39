"""A bounded soak of a multi-process hub: many clients at once, exact accounting.

The scenario is ``flowrl.testing.run_soak`` (shared with ``benchmarks/soak.py``, which runs
it longer and reports throughput and latency): a zmq hub, 64 client connections spread
over two worker processes, producers putting for ``SOAK_SECONDS`` (default 20; set
``FLOWRL_SOAK_SECONDS`` to soak longer), consumers of two tasks draining to end of stream.

Asserted: every sample produced was consumed exactly once by each task (0 lost, 0
duplicated), with the data that belongs to it; every call returned or raised a typed
``FlowRLError`` that was counted and handled (none untyped, none stuck in flight, none
with an unknown outcome); the hub ends empty. No timing is asserted.

The accounting is shown to fail when it should: a hub client that acks nothing while
claiming to (the leases expire and the samples come back) yields duplicates; one that
drops puts while claiming success yields losses.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import flowrl
from flowrl import HubConfig
from flowrl.testing import SOAK_TASKS, SoakConfig, account, run_soak

pytestmark = pytest.mark.integration

SOAK_SECONDS = float(os.environ.get("FLOWRL_SOAK_SECONDS", "20"))


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS) + 240)
def test_soak_with_64_clients_loses_and_duplicates_nothing() -> None:
    report = run_soak(SoakConfig(seconds=SOAK_SECONDS, clients=64, producers=16, processes=2))
    assert report.connected == 64, "all 64 clients were connected at the same time"
    assert report.produced > 0
    for task in SOAK_TASKS:
        assert report.lost[task] == 0, report
        assert report.duplicated[task] == 0, report
        assert report.consumed[task] == report.produced, report
    assert report.corrupt == 0
    assert report.untyped == 0, report.untyped_examples
    assert report.stuck == []
    assert report.ambiguous == 0
    assert set(report.errors) <= {"Timeout", "EndOfStream", "NothingReady", "HubFull"}, report
    assert {"put", "claim", "get", "ack"} <= set(report.calls)
    assert (report.hub_live, report.hub_leases, report.hub_reserved) == (0, 0, 0)
    assert report.ok


def test_accounting_counts_losses_and_duplicates() -> None:
    assert account([1, 2, 3], [3, 1, 2]) == (0, 0)
    assert account([1, 2, 3], [1, 2]) == (1, 0)
    assert account([1, 2, 3], [1, 2, 3, 2]) == (0, 1)
    assert account([1, 2], [1, 2, 9]) == (0, 1)  # delivered but never produced
    assert account([1, 1], [1]) == (1, 0)  # two samples with one key, one delivered
    assert account([], []) == (0, 0)


def _tiny(**overrides: object) -> SoakConfig:
    fields: dict[str, object] = dict(
        seconds=1.0,
        clients=4,
        producers=2,
        processes=0,  # threads of this process: the fault injected below reaches them
        drain_seconds=20.0,
        claim_timeout=0.2,
        hub_config=HubConfig(capacity=256, n_units=1, lease_timeout=0.5),
    )
    fields.update(overrides)
    return SoakConfig(**fields)  # type: ignore[arg-type]


def test_a_silently_skipped_ack_shows_up_as_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    real_ack = flowrl.RemoteHub.ack
    calls = {"n": 0}

    def sometimes_skip(self, meta, indices=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            return None  # claims success; the lease expires and the samples come back
        return real_ack(self, meta, indices)

    monkeypatch.setattr(flowrl.RemoteHub, "ack", sometimes_skip)
    report = run_soak(_tiny())
    assert report.produced > 0
    assert sum(report.duplicated.values()) > 0
    assert not report.ok


def test_a_silently_dropped_put_shows_up_as_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    real_put = flowrl.RemoteHub.put
    calls = {"n": 0}

    def sometimes_drop(self, data, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            return np.empty(0, dtype=np.int64)  # claims success, stores nothing
        return real_put(self, data, **kwargs)

    monkeypatch.setattr(flowrl.RemoteHub, "put", sometimes_drop)
    report = run_soak(_tiny())
    assert report.produced > 0
    assert all(n > 0 for n in report.lost.values())
    assert not report.ok


def test_soak_config_is_validated() -> None:
    for bad in [
        {"seconds": 0},
        {"clients": 1},
        {"producers": 64},
        {"processes": -1},
        {"batch": True},
        {"address": 3},
    ]:
        with pytest.raises(flowrl.errors.ConfigError):
            SoakConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(flowrl.errors.ConfigError):
        run_soak("fast")  # type: ignore[arg-type]
