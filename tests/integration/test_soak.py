"""Soaks of a multi-process hub with exact accounting: many clients at once, and kills.

The first scenario is ``flowrl.testing.run_soak`` (shared with
``benchmarks/soak_clients.py``, which runs it longer and reports throughput and latency):
a zmq hub, 64 client connections spread over two worker processes, producers putting for
``SOAK_SECONDS`` (default 20; set ``FLOWRL_SOAK_SECONDS`` to soak longer), consumers of
two tasks draining to end of stream.

Asserted: every sample produced was consumed exactly once by each task (0 lost, 0
duplicated), with the data that belongs to it; every call returned or raised a typed
``FlowRLError`` that was counted and handled (none untyped, none stuck in flight, none
with an unknown outcome); the hub ends empty. No timing is asserted.

The accounting is shown to fail when it should: a hub client that acks nothing while
claiming to (the leases expire and the samples come back) yields duplicates; one that
drops puts while claiming success yields losses.

The second is ``benchmarks/soak.py`` (issue 26) for a few seconds: every role, the hub's
servers included, SIGKILLed at least once; 0 lost, 0 duplicated, bounded resources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flowrl
from flowrl import HubConfig
from flowrl.testing import SOAK_TASKS, SoakConfig, account, run_soak

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from _soak_roles import consumed_keys, consumer_records  # noqa: E402

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


# -- issue 26's soak: every role SIGKILLed (benchmarks/soak.py) --------------------------------
KILLED_ROLES = ("producer", "churn", "consumer", "unit", "controller", "publisher", "subscriber")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_with_kills_of_every_role_loses_duplicates_and_leaks_nothing() -> None:
    """A short run of benchmarks/soak.py: producers, a thread-churning producer,
    consumers, a weight publisher and a subscriber, and the controller and storage units
    are each SIGKILLed at least once; every sample is accounted for from the roles' own
    logs, and descriptors, /dev/shm and the journal stay bounded."""
    argv = [sys.executable, str(BENCHMARKS / "soak.py"), "--json", "--duration", "5"]
    argv += ["--kill-every", "0.5", "--lease-timeout", "5"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=840)
    report = json.loads(out.stdout)
    samples = report["samples"]
    assert samples["produced"] > 0
    assert samples["lost"] == {"train": 0, "score": 0}, report["problems"]
    assert samples["duplicated"] == {"train": 0, "score": 0}, report["problems"]
    assert samples["consumed"] == {"train": samples["produced"], "score": samples["produced"]}
    assert samples["corrupt"] == 0
    assert report["weights"]["torn_reads"] == 0 and report["weights"]["read"] > 0
    assert all(report["kills"].get(role, 0) >= 1 for role in KILLED_ROLES), report["kills"]
    assert all(r["recovered"] == r["kills"] for r in report["recovery"].values())
    resources = report["resources"]
    assert all(fds["max"] <= 512 for fds in resources["fds"].values()), resources["fds"]
    assert resources["shm_files"]["after_close"] == 0
    assert resources["journal_bytes"]["max"] <= 4 << 20
    assert report["hub_end"] == {"live": 0, "leases": 0, "reserved": 0}
    assert report["ok"], report["problems"]
    assert out.returncode == 0


def test_soak_accounting_reads_the_consumers_logs() -> None:
    """An ack a consumer could not see (``U``) counts once, unless its samples were acked
    again elsewhere (its lease had expired first); ``X`` (expired at ack) never counts; a
    lease claimed and never settled counts nothing."""
    lines = [
        ["C", "1", "9.0"],
        ["P", "1", "10,11"],
        ["A", "1"],
        ["C", "2", "9.0"],
        ["P", "2", "12"],
        ["X", "2"],
        ["C", "3", "9.0"],
        ["P", "3", "13,14"],
        ["U", "3"],
        ["C", "4", "9.0"],
        ["P", "4", "14"],
        ["A", "4"],
        ["C", "5", "9.0"],
    ]
    records = list(consumer_records(lines))
    assert records == [("A", 1, [10, 11]), ("X", 2, [12]), ("U", 3, [13, 14]), ("A", 4, [14])]
    consumed = consumed_keys(records)
    assert sorted(consumed) == [10, 11, 13, 14]
    assert account([10, 11, 12, 13, 14], consumed) == (1, 0)  # 12 was never acked: lost
    assert account([10, 11], consumed_keys([("A", 1, [10, 11]), ("A", 6, [11])])) == (0, 1)
