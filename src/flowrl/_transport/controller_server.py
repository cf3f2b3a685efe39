"""The controller as a server process: one zmq ROUTER, one event loop, no threads.

Requests are handled in arrival order. A claim (or reserve) that cannot be served yet is
parked, not blocking: it is retried after each state change that may let it proceed (see
``flowrl._controller.wake``) and answered the moment it succeeds — readiness is pushed to
waiters — or with a typed Timeout error when its time is up. Events go out on a PUB
socket; evictions go to the storage units on PUSH sockets. A malformed request gets an
error reply and the server keeps serving.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import zmq

from flowrl._client.base import _split_by_unit
from flowrl._config import HubConfig
from flowrl._controller.controller import Controller
from flowrl._controller.journal import attach_journal
from flowrl._controller.samplers import Sampler
from flowrl._controller.wake import NOBODY, Wake
from flowrl._protocol import commands as cmd
from flowrl._schema.columns import Column
from flowrl._schema.schema import Schema
from flowrl._transport import wire
from flowrl._transport.auth import Gate, HubKey, client_options, listen
from flowrl._transport.pools import ahead_cap, next_cap
from flowrl._transport.sockio import NOBLOCK, has_input, poll_in, recv_parts, send_parts
from flowrl._transport.subscriber import EVENT_TOPICS
from flowrl.errors import ConfigError, FlowRLError, HubFull, NothingReady, SchemaError, Timeout
from flowrl.events import event_encoder

__all__ = ["serve_controller"]

log = logging.getLogger("flowrl.controller")

# Evictions travel to the units in batches: a unit drops one index in about the time it
# drops a thousand, and a sample a consumer acked one at a time would otherwise cost the
# unit a message each. Delaying them is safe: indices are never reused and a unit drops
# only what it still holds under that index.
EVICT_DELAY_S = 0.005
EVICT_BATCH = 4096
# Samplers are stateless: one per distinct spec serves every claim naming it. A client
# could name many specs (group sizes): the cache starts over past this many.
SAMPLERS_MAX = 64
#: How long a reply is kept for a peer the ROUTER does not know (yet): a producer whose
#: socket is still connecting (a new thread's, or any after a controller restart) gets
#: the answer its storage unit's handed-on commit reached us with before it did.
UNROUTED_TTL_S = 10.0
#: How often held replies are tried again.
UNROUTED_RETRY_S = 0.005
_UNROUTABLE = frozenset({errno.EHOSTUNREACH, errno.EAGAIN})


class _Parked:
    __slots__ = ("deadline", "ident", "msg", "rid")

    def __init__(self, ident: bytes, rid: bytes, msg: Any, deadline: float | None) -> None:
        self.ident = ident
        self.rid = rid
        self.msg = msg
        self.deadline = deadline


class ControllerServer:
    def __init__(
        self,
        address: str,
        events_address: str,
        unit_addresses: list[str],
        unit_control_addresses: list[str],
        columns: list[Column],
        tasks: dict[str, list[str]],
        config: HubConfig,
        restarted: bool = False,
        key: str | None = None,
    ) -> None:
        self.config = config
        infer = config.infer_columns if config.infer_columns is not None else not columns
        self.schema = Schema(columns, infer=infer)
        self.ctl = Controller(config.capacity, config.n_units, config.lease_timeout)
        self.journal = None if config.journal is None else attach_journal(self.ctl, config)
        self.schema.declare(*self.ctl.declared.values())
        self.ctl.add_columns(self.schema.columns())
        if not (restarted and self.journal is not None):
            # (a restarted controller's journal holds them since its first start, and not
            # those unregistered since: registering them again would bring those back)
            self.ctl.register_opening_tasks(tasks)
        self.unit_addresses = unit_addresses
        self.events_address = events_address
        self.zctx: zmq.Context = zmq.Context.instance()
        hub_key = None if key is None else HubKey.parse(key)
        self.gate = None if hub_key is None else Gate(hub_key, "controller")
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # (a peer not known yet: see _send)
        listen(self.sock, address, self.gate)
        self.pub = self.zctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        listen(self.pub, events_address, self.gate)
        self.unit_push = []
        for addr in unit_control_addresses:
            s = self.zctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            client_options(s, addr, hub_key)
            s.connect(addr)
            self.unit_push.append(s)
        self.ctl.on_evict = self._evict
        self._subscribed = False  # before the sink: expiring old leases below publishes
        self.ctl.log.sinks.append(self._publish)  # every event, in order, leaves on PUB
        if self.journal is not None:
            # Units may hold bytes of puts the journal never committed: drop them.
            retain = wire.encode(
                wire.Retain(
                    indices=self.ctl.live_indices().tobytes(), below=self.ctl.table.next_index
                )
            )
            for s in self.unit_push:
                s.send(retain)
            if not restarted:  # a new hub on an old journal: the lease holders are gone
                with self.ctl.cond:
                    self.ctl.expire(now=math.inf)
        self.ahead_cap = ahead_cap(config.capacity)
        self.next_cap = next_cap(config.capacity)
        self.parked: list[_Parked] = []
        self._samplers: dict[cmd.SamplerSpec, Sampler] = {}
        self._evictions: list[list[np.ndarray]] = [[] for _ in unit_control_addresses]
        self._evictions_size = 0
        self._evictions_due = math.inf  # when the oldest queued eviction must leave
        self._seen = self.ctl.mark()  # the state parked requests were last tried in
        # replies held for peers the ROUTER cannot route to yet: (until, frames), in order
        self._unrouted: dict[bytes, list[tuple[float, list[Any]]]] = {}
        self.running = True

    # -- loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        with self.ctl.cond:  # one thread owns the controller; the lock is never contended
            self._loop()

    def _loop(self) -> None:
        socks = [self.sock]
        while self.running:
            if poll_in(socks, self._poll_timeout()):
                # Drain everything queued (control messages are small: copied, not
                # zero-copy), then flush evictions and retry parked requests once. (The
                # poll said a message is there: asking the socket again costs as much.)
                while True:
                    self._handle(recv_parts(self.sock))
                    if self.journal is not None and self.journal.compaction_due:
                        self.journal.compact(self.ctl)  # (between two requests)
                    if not (self.running and has_input(self.sock)):
                        break
            self._flush_evictions()
            self._retry_parked(self._changes())
            if self._unrouted:
                self._retry_unrouted()
        self._shutdown()

    def _poll_timeout(self) -> int | None:
        soonest = [p.deadline for p in self.parked if p.deadline is not None]
        if self._unrouted:
            soonest.append(time.monotonic() + UNROUTED_RETRY_S)
        if self._evictions_size:
            soonest.append(self._evictions_due)
        lease = self.ctl.next_deadline()
        candidates = [d - time.monotonic() for d in soonest]
        if lease is not None:
            candidates.append(lease - time.time())
        if not candidates:
            return None
        # zmq takes an int of milliseconds; far deadlines are re-checked after an hour
        return max(0, int(min(min(candidates), 3600.0) * 1000) + 1)

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 3:
            return  # not even an identity + request id + body: nothing to answer
        ident, rid = frames[0], frames[1]
        staged: cmd.Commit | None = None
        handed: wire.CommitFor[cmd.Commit] | None = None
        try:
            msg = wire.decode_request(frames[2])
            if type(msg) is wire.CommitFor:  # from a storage unit: answer the producer
                ident, handed, msg = msg.reply_to, msg, msg.commit
            if isinstance(msg, cmd.Commit) and msg.put_id:
                staged = msg
            reply = self._dispatch(ident, rid, msg)
            if handed is not None and handed.reserve_next:
                reply = self._reserve_next(handed) or reply
        except wire.Malformed as exc:  # a broken or hostile client: one line, no traceback
            log.warning("controller refused a request: %s", exc)
            reply = wire.error_of(exc)
            ident = wire.reply_to_of(frames[2]) or ident  # (a handed commit's producer)
        except FlowRLError as exc:
            reply = wire.error_of(exc)
        except Exception as exc:  # a bug must not take the hub down; the caller learns of it
            log.exception("controller failed on a request")
            reply = wire.error_of(exc)
        if staged is not None:  # before anyone hears of the commit (a claim, the producer)
            self._settle(staged, committed=not isinstance(reply, wire.Error))
        if self.parked and self.ctl.mark() != self._seen:
            # Waiters first: a consumer blocked in claim learns of a put before its
            # producer does (the put's latency to the consumer is what a pipeline waits on).
            self._retry_parked(self._changes())
        if reply is not None:
            self._send(ident, rid, reply)

    def _send(self, ident: bytes, rid: bytes, reply: Any) -> None:
        """Send ``reply`` to ``ident``, or hold it while the ROUTER cannot route it (a
        peer not connected yet, or one whose queue is full) instead of dropping it unsaid:
        it is tried again for ``UNROUTED_TTL_S``, after those held before it."""
        frames = [rid, wire.encode(reply)]
        if ident not in self._unrouted and self._deliver(ident, frames):
            return
        until = time.monotonic() + UNROUTED_TTL_S
        self._unrouted.setdefault(ident, []).append((until, frames))

    def _deliver(self, ident: bytes, frames: list[Any]) -> bool:
        try:
            send_parts(self.sock, [ident, *frames], flags=NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in _UNROUTABLE:
                raise
            return False
        return True

    def _retry_unrouted(self) -> None:
        """Send each peer's held replies, in order; drop those held for ``UNROUTED_TTL_S``
        (a peer still unreachable then is gone)."""
        now = time.monotonic()
        for ident, held in list(self._unrouted.items()):
            while held:
                until, frames = held[0]
                if not self._deliver(ident, frames):
                    if now < until:
                        break
                    log.info("controller dropped a reply to a peer gone for %.0f s", UNROUTED_TTL_S)
                held.pop(0)
            if not held:
                del self._unrouted[ident]

    def _dispatch(self, ident: bytes, rid: bytes, msg: Any) -> Any:
        ctl = self.ctl
        if isinstance(msg, cmd.Claim | cmd.Reserve):
            result = self._try(msg)
            if result is not None:
                return result
            if msg.timeout == 0:
                if isinstance(msg, cmd.Claim):
                    raise NothingReady(f"no {msg.n} samples are ready for task {msg.task!r}")
                raise HubFull(f"the hub is full: no room for {msg.n} more samples")
            deadline = None if msg.timeout is None else time.monotonic() + msg.timeout
            self.parked.append(_Parked(ident, rid, msg, deadline))
            return None
        if isinstance(msg, wire.Hello):
            return wire.Welcome(
                columns=list(self.schema.columns()),
                config=self.config,
                units=self.unit_addresses,
                events=self.events_address,
                version=ctl.version,
            )
        if isinstance(msg, cmd.Declare):
            self.schema.declare(*msg.columns)
            ctl.add_columns(msg.columns)
            return wire.Done()
        if isinstance(msg, cmd.RegisterTask):
            columns = self.schema.check_names(msg.columns, "register_task")
            ctl.register_task(msg.task, columns, msg.partition)
            return wire.Done()
        if isinstance(msg, cmd.UnregisterTask):
            ctl.unregister_task(msg.task)
            return wire.Done()
        if isinstance(msg, cmd.Abort):
            ctl.abort(msg.indices)
            return wire.Done()
        if isinstance(msg, cmd.CheckUpdate):
            units = ctl.check_update(msg.indices, msg.columns, msg.ack)
            return wire.Units(units=units.tobytes())
        if isinstance(msg, cmd.Commit):
            ctl.commit(msg)
            return wire.Done()
        if isinstance(msg, cmd.MetaOf):
            meta = ctl.meta(msg.indices, self.schema.check_names(msg.columns, "meta"))
            return wire.MetaReply(meta=meta.to_wire())
        if isinstance(msg, cmd.Ack):
            ctl.ack(msg.task, msg.lease, msg.indices, drop=msg.drop)
            return wire.Done()
        if isinstance(msg, cmd.Release):
            ctl.release(msg.task, msg.lease)
            return wire.Done()
        if isinstance(msg, cmd.PublishVersion):
            ctl.publish_version(msg.version)
            return wire.Done()
        if isinstance(msg, cmd.EndStream):
            ctl.end_stream(self.schema.check_names(msg.columns, "end_stream"))
            return wire.Done()
        if isinstance(msg, wire.Ping):
            parked = any(p.rid == msg.rid and p.ident == ident for p in self.parked)
            return wire.Pong(parked=parked)
        if isinstance(msg, wire.Stats):
            stats = ctl.statistics()
            if self.gate is not None:
                stats = msgspec.structs.replace(stats, refused_peers=self.gate.refused)
            return wire.StatsReply(stats=stats)
        if isinstance(msg, wire.PublishHello):
            self._subscribed = True
            self.pub.send_multipart([b"h", msg.token.to_bytes(8, "little")])
            return wire.Done()
        if isinstance(msg, wire.Shutdown):
            self.running = False
            return wire.Done()
        raise SchemaError(f"the controller does not serve {type(msg).__name__} requests")

    def _reserve_next(self, handed: wire.CommitFor[cmd.Commit]) -> wire.Reserved | None:
        """Indices for a producer's next put, reserved with this one's commit (one round
        trip a put instead of two), as room allows: never while a put waits for room, nor
        more than a pool may hold; None when there are none."""
        ctl, n = self.ctl, handed.reserve_next
        if (
            n > self.next_cap
            or ctl.ended
            or ctl.table.free_slots() < n
            or any(isinstance(p.msg, cmd.Reserve) for p in self.parked)
        ):
            return None
        try:
            indices, unit = ctl.reserve(n, units=handed.reserve_units, pooled=True)
        except FlowRLError:  # (units that do not exist: the next put reserves itself)
            return None
        return wire.Reserved(indices=indices.tobytes(), unit=unit)

    def _try(self, msg: Any) -> Any:
        ctl = self.ctl
        if isinstance(msg, cmd.Reserve):
            if msg.n > ctl.table.capacity:
                raise HubFull(
                    f"put() of {msg.n} samples can never fit capacity {ctl.table.capacity}"
                )
            # (a client's own pools never ask for more: small puts ahead_cap, a batched
            # put_async whole puts within next_cap)
            cap = max(self.ahead_cap, self.next_cap - msg.n)
            if msg.ahead > cap:
                raise ConfigError(
                    f"Reserve ahead={msg.ahead} exceeds this hub's cap of {cap} indices "
                    f"reserved ahead for a put of {msg.n}"
                )
            if msg.give_back is not None:  # idempotent: a parked retry aborts nothing twice
                ctl.abort(msg.give_back)
            if ctl.table.free_slots() < msg.n and not ctl.ended:
                # Indices producers reserved ahead go back before a put waits for room
                # (a pool may be idle for ever: its thread ended, its client died).
                ctl.reclaim_ahead()
                if ctl.table.free_slots() < msg.n:
                    return None  # (reserve raises EndOfStream once the stream ended)
            indices, unit = ctl.reserve(msg.n, units=msg.units, ahead=msg.ahead)
            units = None
            if indices.size > msg.n:
                units = ctl.table.unit[indices % ctl.table.capacity].astype(np.int16).tobytes()
            return wire.Reserved(indices=indices.tobytes(), unit=unit, units=units)
        if msg.columns is not None:
            self.schema.check_names(msg.columns, "claim")
        metas = ctl.try_claim_batches(msg, self._sampler(msg.sampler))
        if metas is None:
            return None
        return wire.MetaReply(meta=metas[0].to_wire(), more=[m.to_wire() for m in metas[1:]])

    def _sampler(self, spec: cmd.SamplerSpec) -> Sampler:
        sampler = self._samplers.get(spec)
        if sampler is None:
            if len(self._samplers) >= SAMPLERS_MAX:
                self._samplers.clear()
            sampler = self._samplers[spec] = wire.sampler_from_spec(spec)
        return sampler

    def _changes(self) -> Wake:
        """Which parked requests the state changes since they were last tried (expired
        leases and reservations included) may let proceed."""
        self.ctl.expire()
        seen, self._seen = self._seen, self.ctl.mark()
        return self.ctl.woken_since(seen) if self.parked else NOBODY

    def _retry_parked(self, wake: Wake) -> None:
        """Answer parked requests that can proceed now (only worth trying when ``wake``
        says a change may let them) or whose time is up."""
        if not self.parked:
            return
        now = time.monotonic()
        still: list[_Parked] = []
        for p in self.parked:
            reply = None
            if wake.room if isinstance(p.msg, cmd.Reserve) else wake.claim(p.msg.task):
                try:
                    reply = self._try(p.msg)
                except FlowRLError as exc:
                    reply = wire.error_of(exc)
            if reply is None and p.deadline is not None and now >= p.deadline:
                reply = wire.error_of(Timeout(_wait_message(p.msg, p.msg.timeout)))
            if reply is None:
                still.append(p)
            else:
                self._send(p.ident, p.rid, reply)
        self.parked = still

    def _settle(self, commit: cmd.Commit, committed: bool) -> None:
        """Tell the units holding a put's staged bytes whether to file or forget them."""
        settle = wire.encode(wire.Settle(put_id=commit.put_id, committed=committed))
        units: Iterable[int] = range(len(self.unit_push))
        if committed:  # (a refused commit may name samples the table no longer places)
            slots = commit.indices % self.ctl.table.capacity
            units = set(self.ctl.table.unit[slots].tolist())  # (a put is often one sample)
        for unit in units:
            send_parts(self.unit_push[unit], [settle])

    def _evict(self, indices: np.ndarray, units: np.ndarray) -> None:
        """Queue evictions for the units (see EVICT_DELAY_S)."""
        if not self._evictions_size:
            self._evictions_due = time.monotonic() + EVICT_DELAY_S
        self._evictions_size += indices.size
        for unit, pos in _split_by_unit(units):
            self._evictions[unit].append(indices if pos is None else indices[pos])

    def _flush_evictions(self, force: bool = False) -> None:
        """Send the queued evictions, one message per unit, once there are many or the
        oldest has waited ``EVICT_DELAY_S`` (or when ``force``d)."""
        if not self._evictions_size or not (
            force or self._evictions_size >= EVICT_BATCH or time.monotonic() >= self._evictions_due
        ):
            return
        for unit, parts in enumerate(self._evictions):
            if parts:
                evict = wire.Evict(indices=np.concatenate(parts).tobytes())
                self.unit_push[unit].send(wire.encode(evict))
                parts.clear()
        self._evictions_size = 0

    def _publish(self, event: Any) -> None:
        # PUB drops what no subscriber receives; skip the encoding until a client has
        # subscribed (its subscription handshake goes through PublishHello).
        if self._subscribed:
            send_parts(self.pub, [EVENT_TOPICS[type(event)], event_encoder.encode(event)])

    def _shutdown(self) -> None:
        self._flush_evictions(force=True)
        for p in self.parked:
            self._send(p.ident, p.rid, wire.Error(type="HubClosed", message="the hub shut down"))
        for s in [self.sock, self.pub, *self.unit_push]:
            s.close()
        if self.journal is not None:
            self.journal.close()


def _wait_message(msg: Any, timeout: float | None) -> str:
    if isinstance(msg, cmd.Claim):
        return f"claim() by task {msg.task!r} found no {msg.n} ready samples in {timeout}s"
    return f"put() waited {timeout}s for room for {msg.n} samples; the hub is full"


def serve_controller(**kwargs: Any) -> None:
    """Process entry point."""
    ControllerServer(**kwargs).serve()
