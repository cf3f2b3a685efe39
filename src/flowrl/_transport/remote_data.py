"""The zmq data port: bytes to and from the storage unit servers, as zero-copy frames.

A write carries its commit: the unit stores the bytes, then hands the commit to the
controller, which answers the producer (one round trip for a put, which also brings the
next put's indices). A unit on this machine lends its shared memory: a large put's bytes
are written there (``lanes``), and reads map it instead of copying.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, final

import numpy as np
import pyarrow as pa

from flowrl._client.batch import LazyColumn
from flowrl._client.future import PutFuture
from flowrl._client.ports import DataPort
from flowrl._config import UnitStats
from flowrl._protocol import commands
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded
from flowrl._schema.schema import Schema
from flowrl._schema.small import has_negative
from flowrl._store.partial import VERSIONS
from flowrl._store.shm import ShmMaps, ShmUnavailable
from flowrl._transport import wire
from flowrl._transport.frames import (
    ArrayHeader,
    encoded_frames,
    from_frames,
    split_frames,
    to_frames_all,
    window_of,
)
from flowrl._transport.inflight import PutsInFlight
from flowrl._transport.lanes import Lanes, Lent
from flowrl._transport.remote_control import RemoteControl
from flowrl._transport.session import MAY_HAVE_LANDED, NoAnswer, Session
from flowrl.errors import TransportError, UnknownIndexError

__all__ = ["RemoteData"]

log = logging.getLogger("flowrl.client")


@final
class RemoteData(DataPort):
    """Bytes sent to the storage units the session knows; ``abort`` gives back the
    indices of a refused put_async."""

    copies_puts = True

    def __init__(self, session: Session, schema: Schema, control: RemoteControl) -> None:
        self._session = session
        self.schema = schema
        self._control = control
        # Units on this machine (ipc) let reads map their shared memory instead of copying,
        # and lend it to puts (lanes).
        self.n_units = len(session.unit_addresses)
        self._shm = [a.startswith("ipc://") for a in session.unit_addresses]
        self._shm_maps = ShmMaps()
        # A new grant may reuse a segment this client read: let go of the retired ones.
        self._lanes = Lanes(session, self._shm, before_grant=self._shm_maps.forget_retired)
        self.puts = PutsInFlight(session, self.discard, control.abort, control.stream_reserved)
        control.take_answers = self.puts.take_answered

    def write(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        put_id: int = 0,
    ) -> None:
        msg, frames, _ = self._write_request(unit, indices, encoded, types, put_id=put_id)
        self._session.call(unit, msg, frames)

    def write_commit(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        commit: commands.Commit,
        wait: bool,
        again: Callable[[dict[str, Encoded]], np.ndarray] | None,
    ) -> PutFuture | None:
        # The unit hands the commit on once the bytes are stored; the controller answers
        # this thread's controller socket (or the unit, if it refused the write). A new
        # put asks the controller to reserve the next put's indices with its answer (a
        # put_async, to keep its stream's pool full: ``PutsInFlight`` hands them on).
        control = self._control
        if not commit.new:
            reserve_next = 0
        elif wait:
            reserve_next = control.next_ask(indices.size)
        else:
            reserve_next = control.stream_ask(indices.size)
        msg, frames, lent = self._write_request(
            unit,
            indices,
            encoded,
            types,
            commit=commit,
            controller=self._session.address,
            reply_to=self._session.routing_id(),
            put_id=commit.put_id,
            reserve_next=reserve_next,
            reserve_units=control.local_units if reserve_next else None,
        )
        if wait:
            session = self._session
            rid = session.send(unit, msg, frames)
            wait_s = session.reply_wait(unit, or_controller=True)
            try:
                reply, _ = session.recv(unit, rid, wait_s, or_controller=True)
            except NoAnswer as exc:
                if commit.seq is None:
                    exc.add_note(MAY_HAVE_LANDED)
                raise
            if isinstance(reply, wire.Reserved):
                self._control.pool_next(wire.ints(reply.indices), reply.unit)
            return None
        # A put_async returns before its bytes leave (zero-copy frames) or are answered
        # for; the caller may change its arrays meanwhile (``encoded`` are views of them).
        # Lent bytes are copies already: the segment's lock, held with them, keeps them
        # the put's should it be made again. Frames are copied.
        if lent is None:
            frames = [np.frombuffer(frame, dtype=np.uint8).copy() for frame in frames]
        redo = None
        if again is not None:
            copies = frames if lent is None else lent.copies
            keep = None if lent is None else lent.lane
            redo = functools.partial(_redo, again, encoded, copies, keep)
        columns = tuple(encoded)
        return self.puts.send(
            unit, msg, frames, indices, columns, new=commit.new, again=redo, asked=reserve_next
        )

    def discard(self, unit: int, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        try:
            self._session.call(unit, wire.Discard(indices=indices.tobytes(), columns=list(columns)))
        except TransportError:
            log.warning("could not discard uncommitted data on storage unit %d", unit)

    def read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> list[dict[str, pa.Array | LazyColumn]]:
        for _, idx in parts:
            if has_negative(idx):  # a tampered handle: no unit holds such a sample
                raise UnknownIndexError(f"sample index {int(idx.min())} does not exist")
        # One request per storage unit (the parts a unit holds, e.g. several claimed
        # batches, are read together and split again), every unit's sent before any answer
        # is awaited: units serve in parallel.
        by_unit: dict[int, list[int]] = {}
        for i, (unit, _) in enumerate(parts):
            by_unit.setdefault(unit, []).append(i)
        session, names = self._session, list(columns)
        requests = []
        for unit, members in by_unit.items():
            idx = parts[members[0]][1]
            if len(members) > 1:
                idx = np.concatenate([parts[i][1] for i in members])
            read = wire.Read(indices=idx.tobytes(), columns=names, shm=self._shm[unit])
            requests.append((unit, members, session.send(unit, read)))
        out: list[dict[str, pa.Array | LazyColumn]] = [{} for _ in parts]
        for unit, members, rid in requests:
            reply, frames = session.recv(unit, rid, session.reply_wait(unit))
            try:
                buffers = (
                    [f.buffer for f in frames]
                    if reply.refs is None
                    else self._shm_maps.buffers(reply.refs, frames, unit)
                )
            except ShmUnavailable:  # another machine's (or container's) /dev/shm: frames
                log.info("storage unit %d's shared memory is not visible here", unit)
                self._shm[unit] = False
                return self.read_many(parts, columns)
            sizes = [parts[i][1].size for i in members]
            for i, arrays in zip(
                members, self._arrays_of(unit, reply, buffers, sizes), strict=True
            ):
                out[i] = arrays
        return out

    def _arrays_of(
        self, unit: int, reply: wire.Arrays, buffers: list[Any], sizes: list[int]
    ) -> list[dict[str, pa.Array | LazyColumn]]:
        """Each column a read answered, cut in consecutive runs of ``sizes`` rows (one per
        part read together): numpy views over the received bytes (Arrow arrays built on
        demand), Arrow arrays for strings, objects and bools."""
        out: list[dict[str, pa.Array | LazyColumn]] = [{} for _ in sizes]
        reply_of = f"storage unit {unit}'s reply"
        starts = reply.starts  # whole chunks: the rows read start there
        if starts is not None and len(starts) != len(reply.arrays):
            raise TransportError(f"{reply_of} names {len(starts)} starts for its arrays")
        n = sum(sizes)
        by_name = self.schema.by_name
        for i, (header, bufs) in enumerate(
            zip(reply.arrays, split_frames(reply.arrays, buffers, reply_of), strict=True)
        ):
            start = 0 if starts is None else starts[i]
            if start + n > header.length or (starts is None and header.length != n):
                raise TransportError(f"storage unit {unit} returned the wrong row count")
            column = by_name.get(header.column) or self.schema[header.column]
            whole: pa.Array | None = None
            for arrays, size in zip(out, sizes, strict=True):
                rows = window_of(column, header, bufs, start, size)
                if rows is None:
                    if whole is None:
                        whole = from_frames(column, header, bufs)
                    rows = whole if header.length == size else whole.slice(start, size)
                arrays[header.column] = rows
                start += size
        return out

    def append(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]:
        reply, _ = self._session.call(unit, *_append_request(indices, values, version))
        lengths = wire.ints(reply.lengths)
        if lengths.size != len(values) * indices.size:
            raise TransportError(f"storage unit {unit} answered an append malformed")
        return list(lengths.reshape(len(values), indices.size))

    def append_async(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> PutFuture:
        # (the arrays are the client's own, made by encode: the frames go out zero-copy)
        msg, frames = _append_request(indices, values, version)
        return self.puts.send(unit, msg, frames, indices, (), new=False, again=None)

    def read_partial(
        self, unit: int, indices: np.ndarray, column: Column
    ) -> tuple[pa.Array, pa.Array]:
        reply, frames = self._session.call(
            unit, wire.ReadPartial(indices=indices.tobytes(), column=column)
        )
        if len(reply.arrays) != 2 or any(h.length != indices.size for h in reply.arrays):
            raise TransportError(f"storage unit {unit} answered a partial read malformed")
        values_h, versions_h = reply.arrays
        split = values_h.frames
        return (
            from_frames(column, values_h, [f.buffer for f in frames[:split]]),
            from_frames(VERSIONS, versions_h, [f.buffer for f in frames[split:]]),
        )

    def statistics(self) -> list[UnitStats]:
        call = self._session.call
        return [call(u, wire.UnitStatsReq())[0].stats for u in range(self.n_units)]

    def flush(self, timeout: float | None) -> None:
        self.puts.flush(timeout)

    def raise_failed_put(self) -> None:
        self.puts.raise_failed()

    def close(self) -> None:
        self._shm_maps.clear()
        self._lanes.close()

    def _write_request(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        **commit: Any,
    ) -> tuple[wire.Write, list[Any], Lent | None]:
        """A Write, its payload frames (one per buffer) and None; or, when the payload went
        to memory the unit lent, no frames and what was lent."""
        headers: list[ArrayHeader] = []
        frames: list[Any] = []
        for name, column in encoded.items():
            header, buffers = encoded_frames(name, column)
            headers.append(header)
            frames.extend(buffers)
        lent = self._lanes.lend(unit, frames)
        if lent is not None:
            commit.update(lent.fields)
            frames = []
        msg = wire.write_request(
            indices.tobytes(), [types[name] for name in encoded], headers, **commit
        )
        return msg, frames, lent


def _append_request(
    indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
) -> tuple[wire.Append, list[Any]]:
    headers, frames = to_frames_all(values)
    msg = wire.Append(
        indices=indices.tobytes(), columns=[c for c, _ in values], version=version, arrays=headers
    )
    return msg, frames


def _encoded_over(encoded: dict[str, Encoded], copies: list[Any]) -> dict[str, Encoded]:
    """``encoded`` over ``copies`` of its frames (in order, as ``encoded_frames`` lists
    them): numeric columns' buffers replaced by the copies, the others (their own Arrow
    arrays, not the caller's) kept."""
    out, pos = {}, 0
    for name, column in encoded.items():
        header, buffers = encoded_frames(name, column)
        if column.buffers is not None:
            column = Encoded(
                column.column,
                column.length,
                column.nbytes,
                column.lengths,
                buffers=[
                    np.frombuffer(copy, dtype=buf.dtype).reshape(buf.shape)
                    for copy, buf in zip(copies[pos : pos + header.frames], buffers, strict=True)
                ],
            )
        out[name] = column
        pos += header.frames
    return out


def _redo(
    again: Callable[[dict[str, Encoded]], np.ndarray],
    encoded: dict[str, Encoded],
    copies: list[Any],
    lane: object,
) -> np.ndarray:
    """Make a put_async again from the ``copies`` of its frames (``encoded``: the put's
    columns, for their layout; ``lane``: held while the put may be made again, its lock
    keeps the lent copies from being reused)."""
    return again(_encoded_over(encoded, copies))
