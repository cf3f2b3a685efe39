"""A storage unit as a server process: ROUTER for clients, PULL for the controller's evictions.

Writes arrive as a header frame followed by one frame per Arrow buffer; the arrays are
built over the received frames without copying and kept as they are (a large write is
copied once, whole, into the unit's shared memory instead). A client on this machine
writes a large put into shared memory the unit lent it (``Grant``; see
``flowrl._transport.lanes``) and the write names where the bytes lie: the unit builds
its arrays over them as they are. Reads answer with the same
layout, sending Arrow memory zero-copy; a reader on the same machine is told where the
bytes lie in shared memory instead, and for rows that one put wrote (the usual FIFO read)
the unit names each column's whole chunk and the first row, which the reader slices: the
unit touches no array for such a read.

A write may carry its commit: once the bytes are stored, the unit hands the commit to the
controller, which answers the producer directly. A put then costs three hops (producer →
unit → controller → producer) instead of four, and its samples become claimable one hop
sooner. The unit never waits for the controller.

A write to existing samples (``Write.put_id``) is staged, not stored: the values
committed before stay what reads return until the controller's verdict on the put
(``Settle``, on the control socket) files the bytes or forgets them — a put refused for an
expired lease or a closed column changes nothing. A request naming a sample with a staged
write waits (the unit serves others meanwhile) until the verdict arrives: a consumer that
claimed a sample the commit made ready may reach the unit before the verdict does. A
verdict that never comes (the producer or the controller died) is taken as a refusal
after ``STAGED_TTL_S``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import msgspec
import numpy as np
import pyarrow as pa
import zmq

from flowrl._config import JournalConfig
from flowrl._schema.columns import Column
from flowrl._store.partial import VERSIONS
from flowrl._store.shm import SHM_MIN_BYTES, ShmArena
from flowrl._store.unit import Deferred, StorageUnit
from flowrl._transport import wire
from flowrl._transport.auth import Gate, HubKey, client_options, listen
from flowrl._transport.frames import (
    ZERO_COPY_MIN_BYTES,
    ArrayHeader,
    check_frames,
    from_frames,
    split_frames,
    to_frames_all,
)
from flowrl._transport.lanes import GRANT_IDLE_S
from flowrl._transport.sockio import NOBLOCK, poll_in, recv_parts, send_parts
from flowrl.errors import FlowRLError, SchemaError, TransportError, UnknownIndexError

__all__ = ["serve_unit"]

log = logging.getLogger("flowrl.unit")

#: Controller addresses a unit keeps a socket to (a restarted Ray controller may move).
MAX_CONTROLLERS = 4
#: Seconds a staged write waits for the controller's verdict before it is forgotten.
STAGED_TTL_S = 120.0
#: Grants of shared memory a unit keeps (the least recently used goes: its client's next
#: write there is refused, and a dead client's grant does not keep a segment for ever).
MAX_GRANTS = 64


class _InShm(NamedTuple):
    """A chunk whose buffers all lie in the arena: its write header and where they are."""

    header: ArrayHeader
    refs: list[wire.ShmRef]


class _Lent(NamedTuple):
    """Shared memory lent to one client socket (``wire.Grant``): its view keeps the segment
    alive; ``cursor[0]``: where the bytes not yet named by a write begin."""

    ident: bytes
    view: memoryview
    path: str
    offset: int
    cursor: list[int]
    used: list[float]  # when a write last named it (monotonic)


class UnitServer:
    def __init__(
        self,
        unit_id: int,
        capacity: int,
        address: str,
        control_address: str,
        journal: JournalConfig | None = None,
        shm_folder: str | None = None,
        key: str | None = None,
    ) -> None:
        self.unit = StorageUnit.open(unit_id, capacity, journal)
        self.arena = None if shm_folder is None else ShmArena(shm_folder, spare=True)
        self.columns: dict[str, Column] = dict(self.unit.declared)
        self.zctx: zmq.Context = zmq.Context.instance()
        self.key = None if key is None else HubKey.parse(key)
        self.gate = None if self.key is None else Gate(self.key, f"storage unit {unit_id}")
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        listen(self.sock, address, self.gate, data=True)
        self.control = self.zctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        listen(self.control, control_address, self.gate)
        self.controllers: dict[str, zmq.Socket] = {}  # address -> DEALER, for commits
        # staged writes by the time their verdict is given up on; requests that wait for one
        self._staged: collections.deque[tuple[float, int]] = collections.deque()
        self._waiting: list[tuple[list[Any], np.ndarray]] = []
        self._lent: collections.OrderedDict[int, _Lent] = collections.OrderedDict()
        self._grant_of: dict[bytes, int] = {}  # client socket -> its latest grant
        self._grant_ids = itertools.count(1)
        self.running = True

    def serve(self) -> None:
        socks = [self.control, self.sock]  # (a verdict first: a request may wait for it)
        staged = self._staged
        while self.running:
            ready = poll_in(socks, self._poll_timeout() if staged else None)
            for sock in ready:
                if sock is self.sock:
                    self._handle(recv_parts(sock, copy=False))
                else:
                    self._control(sock.recv(copy=False))
            if staged:
                self._expire_staged()
        for sock in [self.sock, self.control, *self.controllers.values()]:
            sock.close()
        self.unit.close()
        if self.arena is not None:
            self.arena.close()

    def _control(self, frame: Any) -> None:
        try:
            msg = wire.decode_request(frame.buffer)
            kind = type(msg)
            if kind is wire.Settle:
                if self.unit.settle(msg.put_id, msg.committed):
                    if self._waiting:
                        self._serve_waiting()
                elif msg.committed:
                    log.error(
                        "storage unit %d: put %d was committed after its bytes were "
                        "forgotten (no verdict for %.0f s)",
                        self.unit.unit_id,
                        msg.put_id,
                        STAGED_TTL_S,
                    )
            elif kind is wire.Evict:
                self.unit.evict(wire.ints(msg.indices))
            elif kind is wire.Retain:
                self.unit.retain(wire.ints(msg.indices), msg.below)
            elif kind is wire.Shutdown:
                self.running = False
        except wire.Malformed as exc:
            log.warning("storage unit %d dropped a control message: %s", self.unit.unit_id, exc)
        except Exception:
            log.exception("storage unit %d failed on a control message", self.unit.unit_id)

    # -- staged writes ---------------------------------------------------------------------
    def _poll_timeout(self) -> int:
        """Until the oldest staged write's verdict is due (milliseconds)."""
        return max(0, int((self._staged[0][0] - time.monotonic()) * 1000) + 1)

    def _expire_staged(self) -> None:
        """Forget staged writes whose verdict never came."""
        now = time.monotonic()
        expired = False
        while self._staged and (
            self._staged[0][0] <= now or not self.unit.is_staged(self._staged[0][1])
        ):
            _, put_id = self._staged.popleft()
            if self.unit.settle(put_id, False):
                expired = True
                log.warning(
                    "storage unit %d forgot put %d: no verdict on its commit in %.0f s",
                    self.unit.unit_id,
                    put_id,
                    STAGED_TTL_S,
                )
        if expired:
            self._serve_waiting()

    def _must_wait(self, frames: list[Any], msg: Any) -> bool:
        """Hold a request naming a sample with a staged write until its verdict."""
        if not self.unit.has_staged:
            return False
        indices = getattr(msg, "indices", None)
        if not isinstance(indices, bytes):
            return False
        idx = wire.ints(indices)
        if not self.unit.staged(idx):
            return False
        self._waiting.append((frames, idx))
        return True

    def _serve_waiting(self) -> None:
        """Serve, in arrival order, the held requests no staged write holds up any more."""
        waiting, self._waiting = self._waiting, []
        for frames, idx in waiting:
            if self.unit.staged(idx):
                self._waiting.append((frames, idx))
            else:
                self._handle(frames, checked=True)

    def _handle(self, frames: list[Any], checked: bool = False) -> None:
        if len(frames) < 3:
            return
        ident, rid = frames[0].bytes, frames[1].bytes
        out: list[Any] = []
        try:
            msg = wire.decode_request(frames[2].buffer)
            if not checked and self._must_wait(frames, msg):
                return
            if type(msg) is wire.Write:
                if msg.put_id:
                    self._stage(ident, rid, msg, frames[3:])
                    return
                if msg.has_commit:
                    self._write_and_hand_on(ident, rid, msg, frames[3:])
                    return
            reply = self._dispatch(ident, msg, frames[3:], out)
        except wire.Malformed as exc:  # a broken or hostile client: one line, no traceback
            log.warning("storage unit %d refused a request: %s", self.unit.unit_id, exc)
            reply, out = wire.error_of(exc), []
        except FlowRLError as exc:
            reply, out = wire.error_of(exc), []
        except Exception as exc:
            log.exception("storage unit %d failed on a request", self.unit.unit_id)
            reply, out = wire.error_of(exc), []
        self._reply(ident, rid, reply, out)

    def _reply(self, ident: bytes, rid: bytes, reply: Any, payload: Sequence[Any] = ()) -> None:
        """Send ``reply`` (and its payload frames, zero-copy when large) to client ``ident``."""
        if not payload:
            send_parts(self.sock, [ident, rid, wire.encode(reply)])
            return
        small = sum(memoryview(f).nbytes for f in payload) < ZERO_COPY_MIN_BYTES
        send_parts(self.sock, [ident, rid, wire.encode(reply), *payload], copy=small)

    # -- commits handed to the controller ----------------------------------------------------
    def _write_and_hand_on(
        self, ident: bytes, rid: bytes, msg: wire.Write, payload: list[Any]
    ) -> None:
        """Store a write and hand its commit to the controller. The commit leaves as soon as
        nothing can refuse the write (``StorageUnit.write``'s ``on_accepted``), so the
        controller works while this unit files the bytes; it reads nothing before that."""
        handed = False

        def hand_on() -> None:
            nonlocal handed
            handed = True
            self._forward(ident, rid, msg)

        try:
            self._write(ident, msg, payload, hand_on)
        except Exception:
            if not handed:
                raise  # refused: the producer gets the error
            log.exception("storage unit %d failed filing an accepted write", self.unit.unit_id)

    def _stage(self, ident: bytes, rid: bytes, msg: wire.Write, payload: list[Any]) -> None:
        """Stage a write to existing samples; hand its commit on (or answer the producer,
        which commits itself)."""
        indices, build, types, tags = self._prepare(ident, msg, payload)
        self.unit.stage(msg.put_id, indices, build, types, tags)
        self.columns = types
        self._staged.append((time.monotonic() + STAGED_TTL_S, msg.put_id))
        if msg.has_commit:
            self._forward(ident, rid, msg)
        else:
            self._reply(ident, rid, wire.Done())

    def _forward(self, ident: bytes, rid: bytes, msg: wire.Write) -> None:
        """The controller answers the producer (``msg.reply_to``, its routing id there) under
        the producer's request id; a refused commit leaves the bytes for the producer to
        discard, as a direct commit would. The commit goes on as the producer encoded it."""
        handoff = wire.encode(
            wire.CommitFor(
                commit=msg.commit,
                reply_to=msg.reply_to,
                reserve_next=msg.reserve_next,
                reserve_units=msg.reserve_units,
            )
        )
        try:
            send_parts(self._controller(msg.controller), [rid, handoff], flags=NOBLOCK)
        except zmq.ZMQError as exc:
            err = TransportError(f"storage unit could not reach the controller: {exc}")
            self._reply(ident, rid, wire.error_of(err))

    def _controller(self, address: str) -> zmq.Socket:
        sock = self.controllers.get(address)
        if sock is None:
            if len(self.controllers) >= MAX_CONTROLLERS:
                self.controllers.pop(next(iter(self.controllers))).close()
            sock = self.zctx.socket(zmq.DEALER)  # send-only: the producer gets the reply
            sock.setsockopt(zmq.LINGER, 0)
            client_options(sock, address, self.key)
            sock.connect(address)
            self.controllers[address] = sock
        return sock

    # -- shared memory ------------------------------------------------------------------------
    def _grant(self, ident: bytes, size: int) -> wire.Granted:
        """Lend ``size`` fresh bytes of the arena to the client socket ``ident``."""
        placed = None
        if self.arena is not None and 0 < size <= self.arena.segment_bytes:
            placed = self.arena.allocate(size)
        if placed is None:
            return wire.Granted(grant=0)
        grant = next(self._grant_ids)
        # A client socket writes to its latest grant only (its earlier writes, sent on the
        # same socket, arrived first): the one before is let go, and with it its segment.
        self._lent.pop(self._grant_of.pop(ident, 0), None)
        now = time.monotonic()
        self._lent[grant] = _Lent(ident, placed.view, placed.path, placed.offset, [0], [now])
        self._grant_of[ident] = grant
        # Grants of clients gone (or idle: a client asks anew after GRANT_IDLE_S / 2) go.
        while len(self._lent) > MAX_GRANTS or self._oldest_idle(now):
            self._grant_of.pop(self._lent.popitem(last=False)[1].ident, None)
        return wire.Granted(grant=grant, path=placed.path, offset=placed.offset, size=size)

    def _oldest_idle(self, now: float) -> bool:
        oldest = next(iter(self._lent.values()))
        return now - oldest.used[0] > GRANT_IDLE_S

    def _lent_buffers(self, ident: bytes, msg: wire.Write, payload: list[Any]) -> list[Any]:
        """The buffers a write names in lent memory (each after the previous, none named
        before: a lent byte is written once, so stored arrays never change)."""
        lent = self._lent.get(msg.grant)
        if lent is None or lent.ident != ident or payload or msg.refs is None:
            raise wire.Malformed(
                f"a write names shared memory of grant {msg.grant}, which this unit did not "
                "lend to its sender (or no longer holds: it keeps the latest "
                f"{MAX_GRANTS}), or sends frames as well"
            )
        self._lent.move_to_end(msg.grant)
        lent.used[0] = time.monotonic()
        bufs = []
        cursor, size = lent.cursor[0], lent.view.nbytes
        for ref in msg.refs:
            start = ref.offset - lent.offset
            if ref.path != lent.path or start < cursor or start + ref.size > size:
                raise wire.Malformed("a write names shared memory outside its grant's free part")
            bufs.append(lent.view[start : start + ref.size])
            cursor = start + ref.size
        lent.cursor[0] = cursor
        return bufs

    def _copy_in(self, bufs: list[Any]) -> tuple[list[Any], list[wire.ShmRef] | None]:
        """An array's buffers copied into the arena, and where they lie there (None unless
        all of them fit: those that did not stay where they are)."""
        assert self.arena is not None
        placed = [self.arena.copy_in(buf) for buf in bufs]
        kept = [buf if p is None else p.view for buf, p in zip(bufs, placed, strict=True)]
        if any(p is None for p in placed):
            return kept, None
        return kept, [wire.ShmRef(p.path, p.offset, p.view.nbytes) for p in placed if p]

    def _ref(self, buf: Any) -> wire.ShmRef | None:
        """Where a buffer to send lies in the arena; None: send it as a frame."""
        if not isinstance(buf, pa.Buffer) or buf.size < SHM_MIN_BYTES:
            return None
        assert self.arena is not None
        where = self.arena.locate(buf.address, buf.size)
        return None if where is None else wire.ShmRef(where[0], where[1], buf.size)

    def _write(
        self,
        ident: bytes,
        msg: wire.Write,
        payload: list[Any],
        on_accepted: Callable[[], None] | None = None,
    ) -> None:
        indices, build, types, tags = self._prepare(ident, msg, payload)
        self.unit.write(indices, build, types, on_accepted, tags)
        self.columns = types  # learnt only from a write that succeeded

    def _prepare(
        self, ident: bytes, msg: wire.Write, payload: list[Any]
    ) -> tuple[np.ndarray, Callable[[], dict[str, Deferred]], dict[str, Column], dict[str, Any]]:
        """A write's indices, the function building its arrays (into shared memory when
        large), its columns' types and the tags ``build`` fills; checked, nothing built."""
        indices = wire.ints(msg.indices)
        if msg.put_id and not self.unit.holds(indices):
            raise UnknownIndexError(
                f"storage unit {self.unit.unit_id} holds no sample of some of indices "
                f"{indices[:4].tolist()}... (evicted); nothing was written"
            )
        types = self.columns  # (replaced, never changed: copied before a column is added)
        for col in wire.columns_of(msg):
            known = types.get(col.name)
            if known is None:
                types = {**types, col.name: col}
            elif known != col:
                raise SchemaError(
                    f"write declares column {col.name!r} as {col.describe()}, but this "
                    f"unit holds it as {known.describe()}"
                )
        # The payload: frames, or the bytes the producer wrote in lent shared memory.
        lent = msg.grant != 0
        buffers = self._lent_buffers(ident, msg, payload) if lent else [f.buffer for f in payload]
        refs_of = split_frames(msg.arrays, msg.refs or [], "write request") if lent else None
        checked = []
        for i, (header, bufs) in enumerate(
            zip(msg.arrays, split_frames(msg.arrays, buffers, "write request"), strict=True)
        ):
            known = types.get(header.column)
            if known is None:
                raise SchemaError(f"write names column {header.column!r} without its type")
            if header.length != indices.size:
                raise TransportError(f"column {header.column!r}: length != number of indices")
            lent_refs = None if refs_of is None else refs_of[i]
            checked.append((header, bufs, check_frames(known, header, bufs), lent_refs))
        # A write large enough to be read in place goes to shared memory whole, so a read
        # of its rows can name its chunks' buffers instead of slicing them (see _dispatch).
        to_shm = (
            not lent and self.arena is not None and sum(b.nbytes for b in buffers) >= SHM_MIN_BYTES
        )
        tags: dict[str, _InShm] = {}  # (filled as the arrays are built, before they are filed)

        def build() -> dict[str, Deferred]:
            # (Arrow arrays only when a read needs them: a read of whole puts in shared
            # memory names their buffers there)
            arrays = {}
            for header, bufs, build_array, refs in checked:
                if to_shm:
                    bufs, refs = self._copy_in(bufs)
                if refs is not None:
                    tags[header.column] = _InShm(header, refs)
                nbytes = sum(memoryview(b).nbytes for b in bufs)
                arrays[header.column] = Deferred(header.length, nbytes, partial(build_array, bufs))
            return arrays

        return indices, build, types, tags

    def _read(self, msg: wire.Read, out: list[Any]) -> wire.Arrays:
        """Rows of some columns: their buffers as payload frames (``out``), or where they
        lie in shared memory for a reader on this machine."""
        indices = wire.ints(msg.indices)
        columns = tuple(msg.columns)
        if msg.shm and self.arena is not None:
            # The usual read: rows one put wrote, in order. Name each column's chunk
            # (where its buffers lie) and the first row; the reader slices.
            run = self.unit.read_run(indices, columns)
            if run:
                chunks = [cast(_InShm, tag) for tag, _ in run]
                return wire.Arrays(
                    arrays=[c.header for c in chunks],
                    refs=[ref for c in chunks for ref in c.refs],
                    starts=[start for _, start in run],
                )
        arrays = self.unit.read(indices, columns)
        headers, bufs = to_frames_all((self.columns[name], a) for name, a in arrays.items())
        if not msg.shm or self.arena is None:
            out.extend(bufs)
            return wire.Arrays(arrays=headers)
        refs = [self._ref(buf) for buf in bufs]
        out.extend(buf for buf, ref in zip(bufs, refs, strict=True) if ref is None)
        return wire.Arrays(arrays=headers, refs=refs)

    def _dispatch(self, ident: bytes, msg: Any, payload: list[Any], out: list[Any]) -> Any:
        kind = type(msg)
        if kind is wire.Read:
            return self._read(msg, out)
        if kind is wire.Write:
            self._write(ident, msg, payload)
            return wire.Done()
        if kind is wire.Grant:
            return self._grant(ident, msg.size)
        if isinstance(msg, wire.Append):
            indices = wire.ints(msg.indices)
            if [h.column for h in msg.arrays] != [c.name for c in msg.columns] or any(
                h.length != indices.size for h in msg.arrays
            ):
                raise TransportError("append request: headers do not match its columns")
            parts = split_frames(msg.arrays, payload, "append request")
            values = []
            for column, header, frames in zip(msg.columns, msg.arrays, parts, strict=True):
                if column.kind != "ragged":
                    raise SchemaError(f"append() extends ragged columns only, not {column.name!r}")
                values.append((column, from_frames(column, header, [f.buffer for f in frames])))
            lengths = self.unit.append(indices, values, msg.version)
            return wire.Lengths(lengths=np.concatenate(lengths).tobytes())
        if isinstance(msg, wire.ReadPartial):
            prefixes = self.unit.read_partial(wire.ints(msg.indices), msg.column)
            headers, bufs = to_frames_all(zip((msg.column, VERSIONS), prefixes, strict=True))
            out.extend(bufs)
            return wire.Arrays(arrays=headers)
        if isinstance(msg, wire.Discard):
            self.unit.discard(wire.ints(msg.indices), tuple(msg.columns))
            return wire.Done()
        if isinstance(msg, wire.UnitStatsReq):
            stats = self.unit.statistics()
            if self.gate is not None:
                stats = msgspec.structs.replace(stats, refused_peers=self.gate.refused)
            return wire.UnitStatsReply(stats=stats)
        if isinstance(msg, wire.Shutdown):
            self.running = False
            return wire.Done()
        raise SchemaError(f"a storage unit does not serve {type(msg).__name__} requests")


def serve_unit(**kwargs: Any) -> None:
    """Process entry point."""
    UnitServer(**kwargs).serve()
