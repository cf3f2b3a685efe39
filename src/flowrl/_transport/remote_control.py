"""The zmq control port: commands to the controller server, as their msgspec Structs.

Blocking commands (a claim, a reserve waiting for room) wait in the controller, which
answers when they can proceed (``Session.call_parked``). Small puts take indices reserved
ahead in an earlier put's round trip (``pools``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, final

import msgspec
import numpy as np

from flowrl._client.ports import ControlPort, Reservation
from flowrl._config import HubConfig, HubStats
from flowrl._controller.eventlog import EventLog
from flowrl._controller.meta import BatchMeta
from flowrl._controller.reservations import RESERVATION_MIN_S
from flowrl._controller.samplers import Sampler
from flowrl._protocol import commands
from flowrl._schema.columns import Column
from flowrl._schema.schema import Schema
from flowrl._transport import wire
from flowrl._transport.pools import STREAM_AHEAD, Pool, Pools, ahead_cap, next_cap
from flowrl._transport.session import Session
from flowrl._transport.subscriber import EventRelay
from flowrl.errors import FlowRLError

__all__ = ["RemoteControl"]


@final
class RemoteControl(ControlPort):
    """Commands sent to the controller at ``session.address``. ``local_units``: the
    storage units new samples go to (the client's node's), None: any."""

    trusts_handles = True  # the controller's commit checks what check_update would

    def __init__(
        self,
        session: Session,
        schema: Schema,
        config: HubConfig,
        events_address: str,
        local_units: Sequence[int] | None,
    ) -> None:
        self._session = session
        self.schema = schema
        self._events_address = events_address
        self._events: EventRelay | None = None
        self._local_units = None if local_units is None else list(local_units)
        self._local = threading.local()  # this thread's pool of indices reserved ahead
        self._pool_block = ahead_cap(config.capacity)  # small puts reserve ahead (reserve)
        self._next_cap = next_cap(config.capacity)  # batched ones with their commit
        self._pool_ttl = max(config.lease_timeout, RESERVATION_MIN_S) / 2
        #: Settles this thread's put_async answered already, without waiting (set by the
        #: data port that sends them): their answers top the pool up.
        self.take_answers: Callable[[], None] = lambda: None
        self._pools = Pools()  # each thread's current pool, given back when it ends

    def _call(self, cmd: commands.Command | wire.Stats) -> Any:
        return self._session.call(None, cmd)[0]

    def declare(self, columns: tuple[Column, ...]) -> None:
        self._call(commands.Declare(columns=columns))  # the controller checks first
        self.schema.declare(*columns)

    def register_task(self, cmd: commands.RegisterTask) -> None:
        self._call(cmd)

    def unregister_task(self, cmd: commands.UnregisterTask) -> None:
        self._call(cmd)

    def reserve(self, n: int, timeout: float | None, streaming: bool = False) -> Reservation:
        """Fresh indices for a put. Small puts take them from this thread's pool, reserved
        ahead in one round trip with an earlier put's: a small put then costs the write's
        round trip alone. So do batched ``put_async`` (``streaming``): a batched ``put``
        has its commit reserve the next one's indices, but a put_async's answer comes
        later, so it reserves for up to ``STREAM_AHEAD`` more puts of its size at once, and
        its commits reserve for later ones (``stream_ask``) as they are answered: answers
        already here are read before a reserve is sent."""
        pool: Pool | None = getattr(self._local, "pool", None)
        taken = self._take_pooled(n)
        asked: int = getattr(self._local, "asked", 0)
        if taken is None and streaming and asked:
            self.take_answers()
            pool = getattr(self._local, "pool", None)
            taken = self._take_pooled(n)
        if taken is not None:
            return Reservation(*taken, pooled=True)
        if n < self._pool_block:
            ahead = self._pool_block
        elif streaming:  # whole puts, within the cap a pool has (others barely notice it)
            ahead = _stream_ahead(n, self._next_cap)
        else:
            ahead = 0
        # this thread's spent pool, and the pools of this client's threads that ended
        left = self._pools.take_ended() + ([] if pool is None else [pool.rest()])
        give_back = np.concatenate(left) if left else None

        def request(left: float | None) -> commands.Reserve:
            return commands.Reserve(
                n=n, timeout=left, units=self._local_units, ahead=ahead, give_back=give_back
            )

        reply = self._session.call_parked(request, timeout, "a put (waiting for room)")
        topped = getattr(self._local, "pool", None)  # by put_async answers read meanwhile
        if topped is not None and topped is not pool:
            self._pools.retire(topped)
        indices = wire.ints(reply.indices)
        if reply.units is not None and indices.size > n:
            # used within half the reservation's lifetime, so it never expires under a put
            units = np.frombuffer(reply.units, dtype=np.int16)[n:]
            self._local.pool = Pool(indices[n:], units, time.monotonic() + self._pool_ttl)
            self._pools.hold(self._local, self._local.pool)  # replaces the spent one
        return Reservation(indices[:n], reply.unit)

    @property
    def local_units(self) -> list[int] | None:
        """The storage units new samples go to (None: any)."""
        return self._local_units

    def next_ask(self, n: int) -> int:
        """How many indices a put of ``n`` new samples asks its commit to reserve for this
        thread's next put: ``n`` for a batched put (small ones reserve ahead), unless the
        thread's pool still holds that many."""
        if n < self._pool_block or n > self._next_cap:
            return 0
        pool = self._live_pool()
        if pool is not None and pool.left() >= n:
            return 0
        return n

    def stream_ask(self, n: int) -> int:
        """How many indices a put_async of ``n`` new samples asks its commit to reserve for
        this thread's next puts: ``n`` while its pool and the asks not yet answered hold
        fewer than ``reserve``'s streaming ahead (its next ``STREAM_AHEAD`` puts, within a
        pool's cap), else 0. The answers top the pool up (``stream_reserved``)."""
        if not 0 < n <= self._next_cap:
            return 0
        asked: int = getattr(self._local, "asked", 0)
        pool = self._live_pool()
        if asked + (0 if pool is None else pool.left()) >= _stream_ahead(n, self._next_cap):
            return 0
        self._local.asked = asked + n
        return n

    def stream_reserved(self, asked: int, reply: Any) -> None:
        """The answer to a put_async whose commit was asked for ``asked`` indices: those it
        reserved (``wire.Reserved``) go after what this thread's pool holds."""
        self._local.asked = max(0, getattr(self._local, "asked", 0) - asked)
        if type(reply) is not wire.Reserved:
            return  # refused, or no room to reserve ahead: a later put reserves itself
        indices = wire.ints(reply.indices)
        pool = self._live_pool()
        if pool is None or not pool.left():
            self.pool_next(indices, reply.unit)
            return
        self._local.pool = pool.extended(indices, reply.unit)
        self._pools.hold(self._local, self._local.pool)

    def _live_pool(self) -> Pool | None:
        """This thread's pool, unless it has expired."""
        pool: Pool | None = getattr(self._local, "pool", None)
        return pool if pool is not None and time.monotonic() < pool.until else None

    def _take_pooled(self, n: int) -> tuple[np.ndarray, int] | None:
        """``n`` indices from this thread's live pool, or None."""
        pool = self._live_pool()
        return None if pool is None else pool.take(n)

    def pool_next(self, indices: np.ndarray, unit: int) -> None:
        """Indices a commit reserved for this thread's next put (``next_ask``), on ``unit``;
        what the thread's pool had left is given back with its next reserve."""
        old: Pool | None = getattr(self._local, "pool", None)
        if old is not None:
            self._pools.retire(old)
        self._local.pool = Pool(indices, int(unit), time.monotonic() + self._pool_ttl)
        self._pools.hold(self._local, self._local.pool)

    def forget_pool(self) -> None:
        self._local.pool = None

    def abort(self, indices: np.ndarray) -> None:
        self._call(commands.Abort(indices=indices))

    def check_update(self, cmd: commands.CheckUpdate) -> np.ndarray:
        reply = self._call(cmd)
        return np.frombuffer(reply.units, dtype=np.int16)

    def commit(self, cmd: commands.Commit) -> None:
        self._call(cmd)

    def claim(self, cmd: commands.Claim, sampler: Sampler) -> list[BatchMeta]:
        cmd = msgspec.structs.replace(cmd, sampler=wire.spec_of_sampler(sampler))

        def request(left: float | None) -> commands.Claim:
            return msgspec.structs.replace(cmd, timeout=left)

        reply = self._session.call_parked(request, cmd.timeout, f"a claim by task {cmd.task!r}")
        first = BatchMeta.from_wire(reply.meta)
        return [first, *map(BatchMeta.from_wire, reply.more)] if reply.more else [first]

    def meta(self, cmd: commands.MetaOf) -> BatchMeta:
        reply = self._call(cmd)
        return BatchMeta.from_wire(reply.meta)

    def ack(self, cmd: commands.Ack) -> None:
        self._call(cmd)

    def release(self, cmd: commands.Release) -> None:
        self._call(cmd)

    def publish_version(self, cmd: commands.PublishVersion) -> None:
        self._call(cmd)

    def version(self) -> int:
        return self.statistics().version

    def end_stream(self, cmd: commands.EndStream) -> None:
        self._call(cmd)

    def events(self) -> EventLog:
        if self._events is None:
            self._events = EventRelay(self._session, self._events_address)
        return self._events.log

    def flush_events(self, timeout: float | None) -> bool:
        return True if self._events is None else self._events.flush(timeout)

    def raise_policy_error(self) -> None:
        if self._events is not None:
            self._events.log.check()

    def statistics(self) -> HubStats:
        stats: HubStats = self._call(wire.Stats()).stats
        return stats

    def close(self) -> None:
        """Free what the threads reserved ahead (a client that dies leaves it to expire,
        or to the controller, which takes it back when the hub is full); stop the relay."""
        left = self._pools.take_all()
        if left:
            with contextlib.suppress(FlowRLError):
                self._session.call(None, commands.Abort(indices=np.concatenate(left)), wait=1.0)
        if self._events is not None:
            self._events.close()


def _stream_ahead(n: int, cap: int) -> int:
    """Indices a stream of put_async of ``n`` samples holds for its next puts: whole puts,
    up to ``STREAM_AHEAD``, within ``cap`` with the put's own."""
    return min(STREAM_AHEAD, max(0, cap - n) // n) * n
