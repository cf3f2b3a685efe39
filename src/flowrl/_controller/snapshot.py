"""A controller's state as one msgpack document, for journal compaction.

:func:`snapshot_of` captures what replaying the journal up to now would rebuild — the
committed samples' cells, each task's status and ready queue (in order), the leases with
their deadlines, balanced rounds, versions, stream end, counters — and :func:`restore`
puts it into a fresh controller, after which the events journaled since are replayed as
usual. Only committed samples are kept, slot by slot: its size follows the live state,
not the run's length (and each producer's window of recent puts, which is bounded).
Reservations are not state a journal keeps (a recovered controller
never had them), so they are left out here too.

Taken under the controller's lock between two operations (never from inside one: an
operation may emit its event before it is done mutating).
"""

from __future__ import annotations

import msgspec
import numpy as np

from flowrl._controller.controller import Controller
from flowrl._controller.leases import Lease
from flowrl._controller.producers import ProducerRecord
from flowrl._controller.tasks import TaskState
from flowrl._schema.columns import Column
from flowrl.errors import JournalError

__all__ = ["restore", "snapshot_of"]

FORMAT = 1
# per-slot table arrays kept for each live sample, with their dtypes
_TABLE = {
    "partition": np.int32,
    "group": np.int64,
    "version": np.int64,
    "tokens": np.int64,
    "unit": np.int16,
    "created": np.float64,
}


class _Task(msgspec.Struct, frozen=True):
    name: str
    columns: tuple[str, ...]
    missing: bytes  # int16 per live sample
    status: bytes  # int8 per live sample
    queue: bytes  # int64: the READY samples, in delivery order
    consumed: int
    partition: str | None = None  # the partition it reads (None: all)


class _Lease(msgspec.Struct, frozen=True):
    id: int
    task: str
    indices: bytes
    deadline: float
    consumer: str
    dp_rank: int
    taken: bool


class Snapshot(msgspec.Struct, frozen=True):
    seq: int  # the last event the state includes
    capacity: int
    indices: bytes  # int64: the live (committed) samples
    table: dict[str, bytes]  # per-slot arrays at those samples (see _TABLE)
    ready: dict[str, bytes]  # column -> bool per live sample
    nbytes: dict[str, bytes]  # column -> int64 per live sample
    next_index: int
    declared: list[Column]
    tasks: list[_Task]  # in registration order
    leases: list[_Lease]
    rounds: dict[str, list[list[int]]]  # task -> per round, lease id by rank (0: none)
    version: int
    ended: bool
    closed_columns: list[str]
    partitions: dict[str, int]
    next_lease: int
    watermark: int
    format: int = FORMAT
    producers: list[ProducerRecord] = []  # recent puts of idempotent producers
    next_partition: int = 0  # the id the next new partition name gets (0: unknown)
    unregistered: list[str] = []  # tasks unregistered and not registered since


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def snapshot_of(ctl: Controller) -> bytes:
    """The controller's state now (call it under its lock, between operations)."""
    t = ctl.table
    slots = np.flatnonzero((t.owner >= 0) & t.committed)
    snap = Snapshot(
        seq=ctl.log.seq,
        capacity=t.capacity,
        indices=t.owner[slots].tobytes(),
        table={name: getattr(t, name)[slots].tobytes() for name in _TABLE},
        ready={c: arr[slots].tobytes() for c, arr in t.ready.items()},
        # (a cell not ready may hold a former sample's size: kept as 0, as it means nothing)
        nbytes={
            c: np.where(t.ready[c][slots], arr[slots], 0).tobytes() for c, arr in t.nbytes.items()
        },
        next_index=t.next_index,
        declared=list(ctl.declared.values()),
        tasks=[
            _Task(
                st.name,
                st.columns,
                st.missing[slots].tobytes(),
                st.status[slots].tobytes(),
                st.queue.view().tobytes(),
                st.consumed_total,
                st.partition,
            )
            for st in ctl.tasks.values()
        ],
        leases=[
            _Lease(
                le.id, le.task, le.indices.tobytes(), le.deadline, le.consumer, le.dp_rank, le.taken
            )
            for le in ctl.leases.live.values()
        ],
        rounds={task: ids for task, ids in ctl.rounds.open_ids().items() if ids},
        version=ctl.version,
        ended=ctl.ended,
        closed_columns=sorted(ctl.closed_columns),
        partitions=dict(ctl.partitions),
        next_lease=ctl.leases.next_id,
        watermark=ctl.watermark,
        producers=ctl.producers.to_records(),
        next_partition=ctl.next_partition,
        unregistered=sorted(ctl.unregistered),
    )
    return _encoder.encode(snap)


def restore(ctl: Controller, data: bytes, where: str) -> int:
    """Put a snapshot's state into a fresh controller; returns the seq it includes."""
    try:
        snap = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise JournalError(f"{where} is not a flowrl controller snapshot ({exc})") from None
    if snap.format != FORMAT or snap.capacity != ctl.table.capacity:
        raise JournalError(
            f"{where} holds a snapshot of format {snap.format} for capacity {snap.capacity}; "
            f"this flowrl reads format {FORMAT}, and the hub has capacity {ctl.table.capacity}"
        )
    t = ctl.table
    indices = _ints(snap.indices)
    slots = indices % t.capacity
    ctl.replaying = True  # restoring: nothing is emitted
    try:
        ctl.add_columns(tuple(snap.declared))
    finally:
        ctl.replaying = False
    t.owner[slots] = indices
    t.committed[slots] = True
    for name, dtype in _TABLE.items():
        getattr(t, name)[slots] = np.frombuffer(snap.table[name], dtype=dtype)
    for c, data_ in snap.ready.items():
        t.ready[c][slots] = np.frombuffer(data_, dtype=bool)
        t.nbytes[c][slots] = np.frombuffer(snap.nbytes[c], dtype=np.int64)
    t.live = int(indices.size)
    t.next_index = snap.next_index
    for task in snap.tasks:
        pid = -1 if task.partition is None else snap.partitions[task.partition]
        state = TaskState(task.name, task.columns, t.capacity, task.partition, pid)
        state.missing[slots] = np.frombuffer(task.missing, dtype=np.int16)
        state.status[slots] = np.frombuffer(task.status, dtype=np.int8)
        state.queue.push_back(_ints(task.queue))
        state.consumed_total = task.consumed
        ctl.tasks[task.name] = state
    for le in snap.leases:
        lease = Lease(le.id, le.task, _ints(le.indices), le.deadline, le.consumer)
        lease.dp_rank, lease.taken = le.dp_rank, le.taken
        ctl.leases.add(lease)
    live = ctl.leases.live
    for name, rounds in snap.rounds.items():
        for ids in rounds:
            ctl.rounds.add(name, [live[lid] for lid in ids if lid in live], len(ids))
    ctl.version = snap.version
    ctl.ended = snap.ended
    ctl.closed_columns = set(snap.closed_columns)
    ctl.partitions = dict(snap.partitions)
    ctl.partition_names = {pid: name for name, pid in snap.partitions.items()}
    ctl.next_partition = snap.next_partition or max(snap.partitions.values()) + 1
    ctl.unregistered = set(snap.unregistered)
    ctl.leases.next_id = snap.next_lease
    ctl.watermark = snap.watermark
    ctl.producers.restore(snap.producers)
    ctl.log.seq = snap.seq
    return snap.seq


def _ints(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int64).copy()
