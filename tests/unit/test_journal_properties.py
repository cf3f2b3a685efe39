"""Property tests of the controller's journal (hypothesis), on real files.

A journaled embedded hub runs a random sequence of operations — puts of whole and partial
samples, late columns, claims by two tasks that are acked (fully or partly), released or
held, version bumps, end of stream — with compaction at a random threshold or none. The
state of its controller after every operation is the history. Then:

* **a journal cut at any byte** (a crash or power loss mid-append) recovers without an
  error, to exactly the events wholly written before the cut, and so, where the cut falls
  between two operations, to the state after the last of them;
* **compaction** changes nothing a recovery sees: the same operations journaled with
  snapshots every few hundred bytes recover to the state the uncompacted journal gives
  (and the live hub had).

Recovery here is the controller's own (``attach_journal``), without the embedded hub's
step after it that expires the dead process's leases, so leases are compared too.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._controller.controller import Controller
from flowrl._controller.journal import EVENTS_FILE, attach_journal
from flowrl._controller.snapshot import snapshot_of
from flowrl.errors import EndOfStream, HubFull, NothingReady
from flowrl.testing import abandon

COLS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
CAPACITY = 12
NO_COMPACTION = 1 << 62

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(1, 4), st.booleans()),  # n, with reward
        st.tuples(st.just("reward"), st.integers(0, 15), st.just(0)),  # late column
        st.tuples(
            st.just("claim"),
            st.sampled_from(sorted(TASKS)),
            st.integers(1, 4),
            st.sampled_from(["ack", "ack", "ack-part", "release", "hold"]),
        ),
        st.tuples(st.just("ack-held"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("version"), st.just(0), st.just(0)),
        st.tuples(st.just("end"), st.just(0), st.just(0)),
    ),
    max_size=30,
)


def _config(path: str, compact_bytes: int) -> HubConfig:
    journal = JournalConfig(path=path, persist_data=False, compact_bytes=compact_bytes)
    return HubConfig(capacity=CAPACITY, lease_timeout=1e6, journal=journal)


def _state(ctl: Controller) -> dict[str, Any]:
    """Everything recovery rebuilds: the controller's compaction snapshot, less two fields.
    ``next_index``: a recovered controller starts at the journaled watermark, past any
    index the crashed one may have handed out (compared by :func:`_check_recovered`).
    ``table.created``: creation times are never read, and a replay stamps its own."""
    with ctl.cond:
        state = msgspec.msgpack.decode(snapshot_of(ctl))
    del state["table"]["created"], state["next_index"]
    return state


def _check_recovered(ctl: Controller, live: dict[str, Any]) -> None:
    assert _state(ctl) == live
    assert ctl.table.next_index >= live["watermark"]  # no index is ever handed out twice


def _run(path: str, compact_bytes: int, steps: list[tuple]) -> list[tuple[int, dict]]:
    """Run ``steps`` on a journaled hub, then abandon it (a crash); the history:
    ``(events so far, state)`` after construction and after every operation."""
    hub = flowrl.Hub(COLS, tasks=TASKS, config=_config(path, compact_bytes))
    ctl = hub.controller
    history = [(ctl.log.seq, _state(ctl))]
    waiting_reward: list[int] = []  # samples put without their reward
    held: list[Any] = []
    for step in steps:
        _apply(hub, step, waiting_reward, held)
        history.append((ctl.log.seq, _state(ctl)))
    abandon(hub)
    return history


def _apply(hub: flowrl.Hub, step: tuple, waiting_reward: list[int], held: list[Any]) -> None:
    kind = step[0]
    try:
        if kind == "put":
            _, n, with_reward = step
            data: dict[str, Any] = {"ids": [[i, i + 1][: 1 + i % 2] for i in range(n)]}
            if with_reward:
                data["reward"] = np.arange(n, dtype=np.float32)
            idx = hub.put_nowait(data, groups=np.arange(n) // 2)
            if not with_reward:
                waiting_reward += idx.tolist()
        elif kind == "reward" and waiting_reward:
            i = waiting_reward.pop(step[1] % len(waiting_reward))
            hub.put({"reward": np.ones(1, dtype=np.float32)}, indices=[i])
        elif kind == "claim":
            _, task, n, then = step
            meta = hub.claim_nowait(task, n, min_n=1)
            if then == "ack":
                hub.ack(meta)
            elif then == "ack-part":
                hub.ack(meta, meta.indices[:1])
                held.append(meta.subset(np.arange(1, len(meta))) if len(meta) > 1 else None)
            elif then == "release":
                hub.release(meta)
            else:
                held.append(meta)
        elif kind == "ack-held" and held:
            meta = held.pop(step[1] % len(held))
            if meta is not None:
                hub.ack(meta)
        elif kind == "version":
            hub.publish_version(hub.statistics().version + 1)
        elif kind == "end":
            hub.end_stream()
    except (HubFull, NothingReady, EndOfStream):
        pass  # refused without a change: the step is a no-op


def _recover(path: str, compact_bytes: int) -> Controller:
    config = _config(path, compact_bytes)
    ctl = Controller(config.capacity, config.n_units, config.lease_timeout)
    attach_journal(ctl, config).close()
    return ctl


def _record_ends(data: bytes) -> list[int]:
    """Where each whole record of an events.log ends (length-prefixed, as written)."""
    ends, pos = [], 0
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + size > len(data):
            break
        pos += 4 + size
        ends.append(pos)
    return ends


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(
    steps=ops,
    compact_bytes=st.sampled_from([NO_COMPACTION, 200, 600]),
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=6),
)
def test_a_journal_cut_at_any_byte_recovers_a_prefix_of_history(
    steps: list[tuple], compact_bytes: int, cuts: list[float]
) -> None:
    with tempfile.TemporaryDirectory(prefix="flowrl-journal-prop-") as tmp:
        live = os.path.join(tmp, "live")
        history = _run(live, compact_bytes, steps)
        data = (Path(live) / EVENTS_FILE).read_bytes()
        ends = _record_ends(data)
        assert ends[-1:] == [len(data)] or not data  # the live log holds whole records
        first_seq = history[-1][0] - len(ends)  # the snapshot's events precede the log's
        at_boundary = {seq: state for seq, state in history}
        for cut in sorted({int(f * len(data)) for f in cuts} | {0, len(data)}):
            copy = os.path.join(tmp, f"cut{cut}")
            shutil.copytree(live, copy)
            os.truncate(os.path.join(copy, EVENTS_FILE), cut)
            ctl = _recover(copy, compact_bytes)  # never an error
            whole = sum(1 for end in ends if end <= cut)
            assert ctl.log.seq == first_seq + whole, "not exactly the whole records"
            if ctl.log.seq in at_boundary:
                _check_recovered(ctl, at_boundary[ctl.log.seq])
            shutil.rmtree(copy)


@settings(SETTINGS, max_examples=12)
@given(steps=ops, compact_bytes=st.sampled_from([150, 400]))
def test_replay_after_compaction_equals_replay_before(
    steps: list[tuple], compact_bytes: int
) -> None:
    with tempfile.TemporaryDirectory(prefix="flowrl-compaction-prop-") as tmp:
        plain, compacted = os.path.join(tmp, "plain"), os.path.join(tmp, "compacted")
        before = _run(plain, NO_COMPACTION, steps)
        after = _run(compacted, compact_bytes, steps)
        # the two runs agree but for their leases' deadlines (each run's own clock)
        assert [_timeless(s) for _, s in before] == [_timeless(s) for _, s in after]
        _check_recovered(_recover(compacted, compact_bytes), after[-1][1])
        _check_recovered(_recover(plain, NO_COMPACTION), before[-1][1])


def _timeless(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "leases": [{**le, "deadline": None} for le in state["leases"]]}
