"""The key directory: what TransferQueue's controller keeps that a flowrl hub does not.

Per partition, user keys and the sample index each names; per sample, its tag (TransferQueue's
``custom_meta``) and the fields kv puts wrote; and the column declarations, so that a
process reading a field another process declared knows its type. Metadata only, never
payload bytes.

:class:`KeyDirectory` is the state (thread-safe). In-process clients call it directly;
clients in other processes reach it through :class:`DirectoryServer` (a thread of the
process that called ``init``, on a zmq ROUTER socket) and :class:`RemoteDirectory`, with
msgpack-encoded ``msgspec`` messages (never pickle).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq

from flowrl._schema.columns import Column
from flowrl._transport.auth import Gate, HubKey, client_options, listen, require_key
from flowrl.errors import ConfigError, TransportError, UnknownTaskError

__all__ = ["DirectoryServer", "KeyDirectory", "RemoteDirectory"]

_POLL_MS = 100
_WAIT_POLL_S = 0.005
_RPC_TIMEOUT_MS = 60_000

Method = Literal[
    "lookup", "bind", "update", "describe", "listing", "remove", "forget", "remove_partition",
    "declare", "columns", "generation", "sample", "clear_sampler_cache", "sampler_name",
]  # fmt: skip
# Methods of the hub's SamplerRunner (tq.init's controller.sampler), served alongside.
_RUNNER_METHODS = {"sample": "sample", "clear_sampler_cache": "clear_cache"}
# A sampler's hub task another process's clear_partition unregistered: the caller registers
# it again, so it crosses back as itself, not as a TransportError.
_TASK_GONE = UnknownTaskError.__name__ + ": "


class _Entry(msgspec.Struct, gc=False):
    """One sample's key, tag and fields. Untracked by the garbage collector, with its
    fields a tuple and its tag shared-empty until set: a batch of new keys would otherwise
    add thousands of tracked objects, and the full collections they set off cost more than
    the put (an entry references no other entry, so it is in no cycle)."""

    partition: str
    key: str | None
    tag: dict[str, Any] = msgspec.field(default_factory=dict)
    fields: tuple[str, ...] = ()


class KeyDirectory:
    """Keys, tags and fields of a hub's samples, and its column declarations.

    ``generation()`` counts the changes to keys and tags; ``wait_changed`` sleeps until it
    moves (what a replay buffer polling ``kv_list`` waits on instead of a fixed interval).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        self._keys: dict[str, dict[str, int]] = {}  # partition -> key -> sample index
        self._entries: dict[int, _Entry] = {}
        self._columns: dict[str, Column] = {}

    def lookup(self, partition: str, keys: Sequence[str]) -> list[int]:
        """The sample index of each key (-1 for a key the partition does not have)."""
        with self._lock:
            known = self._keys.get(partition, {})
            return [known.get(k, -1) for k in keys]

    def bind(self, partition: str, keys: Sequence[str], indices: Sequence[int]) -> list[int]:
        """Name samples by keys; a key named meanwhile keeps its sample. Returns each key's."""
        _check_lengths("bind", keys, indices)
        with self._lock:
            known = self._keys.setdefault(partition, {})
            out = []
            for key, index in zip(keys, indices, strict=True):
                if key not in known:
                    known[key] = index
                    self._entries[index] = _Entry(partition, key)
                out.append(known[key])
            self._bump()
            return out

    def update(
        self,
        partition: str,
        indices: Sequence[int],
        tags: Sequence[dict[str, Any]] | None,
        fields: Sequence[str],
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Merge a tag into each sample's and record fields written to all of them; what
        :meth:`describe` then says of them (one call, one round trip from another process)."""
        if tags is not None:
            _check_lengths("update", tags, indices)
        with self._lock:
            entries = []
            for i, index in enumerate(indices):
                entry = self._entries.get(index)
                if entry is None:
                    entry = self._entries[index] = _Entry(partition, None)
                if tags is not None:
                    entry.tag.update(tags[i])
                new = tuple(f for f in fields if f not in entry.fields)
                if new:
                    entry.fields += new
                entries.append(entry)
            self._bump()
            return _described(entries)

    def describe(self, indices: Sequence[int]) -> tuple[list[dict[str, Any]], list[str]]:
        """Each sample's tag, and the fields every one of them has (in write order)."""
        with self._lock:
            return _described([self._entries.get(i) for i in indices])

    def listing(self, partition: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition: {key: tag}}`` for one partition (if it has keys) or all."""
        with self._lock:
            names = list(self._keys) if partition is None else [partition]
            return {
                p: {k: dict(self._entries[i].tag) for k, i in self._keys[p].items()}
                for p in names
                if p in self._keys
            }

    def remove(self, partition: str, keys: Sequence[str]) -> list[int]:
        """Forget keys; returns the indices of those the partition had."""
        with self._lock:
            known = self._keys.get(partition, {})
            gone = [known.pop(k) for k in keys if k in known]
            for index in gone:
                self._entries.pop(index, None)
            self._bump()
            return gone

    def forget(self, indices: Sequence[int]) -> None:
        """Forget the keys and tags of samples (evicted by index, not by key)."""
        with self._lock:
            for index in indices:
                entry = self._entries.pop(index, None)
                if entry is not None and entry.key is not None:
                    self._keys[entry.partition].pop(entry.key, None)
            self._bump()

    def remove_partition(self, partition: str) -> None:
        with self._lock:
            self._keys.pop(partition, None)
            for index in [i for i, e in self._entries.items() if e.partition == partition]:
                del self._entries[index]
            self._bump()

    def generation(self) -> int:
        """How many times keys or tags changed so far."""
        with self._lock:
            return self._generation

    def wait_changed(self, since: int, timeout: float) -> int:
        """The generation once it differs from ``since``, or after ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != since, timeout)
            return self._generation

    def _bump(self) -> None:  # with the lock held
        self._generation += 1
        self._changed.notify_all()

    def declare(self, columns: Sequence[Column]) -> None:
        with self._lock:
            for column in columns:
                self._columns.setdefault(column.name, column)

    def columns(self, names: Sequence[str]) -> list[Column]:
        """The declarations of the named columns that some client declared."""
        with self._lock:
            return [self._columns[n] for n in names if n in self._columns]


def _described(entries: Sequence[_Entry | None]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each entry's tag (a copy), and the fields every one of them has (in write order)."""
    tags = [dict(e.tag) if e else {} for e in entries]
    if not entries or any(e is None for e in entries):
        return tags, []
    common = [f for f in entries[0].fields if all(f in e.fields for e in entries)]  # type: ignore[union-attr]
    return tags, common


def _check_lengths(where: str, names: Sequence[Any], indices: Sequence[int]) -> None:
    if len(names) != len(indices):
        raise ConfigError(
            f"key directory {where}: {len(names)} entries for {len(indices)} sample indices"
        )


class _Call(msgspec.Struct, frozen=True):
    method: Method
    args: list[Any]


class _Reply(msgspec.Struct, frozen=True):
    value: Any = None
    error: str = ""


_DEC_CALL = msgspec.msgpack.Decoder(_Call)
_DEC_REPLY = msgspec.msgpack.Decoder(_Reply)
_ENC = msgspec.msgpack.Encoder()
# Arguments and results that are not plain msgpack values, per method.
_ARG_TYPES: dict[str, Any] = {"declare": list[Column]}
_RESULT_TYPES: dict[str, Any] = {"columns": list[Column]}


def _encode_reply(reply: _Reply) -> bytes:
    try:
        return _ENC.encode(reply)
    except (TypeError, ValueError, OverflowError) as e:  # a value msgpack cannot encode
        return _ENC.encode(_Reply(error=f"TypeError: the reply cannot be encoded: {e}"))


class DirectoryServer:
    """Serves a :class:`KeyDirectory` on a zmq ROUTER socket from a daemon thread, and the
    hub's sampler (a ``SamplerRunner``, if ``tq.init`` was given one)."""

    def __init__(
        self, directory: KeyDirectory, address: str, runner: Any = None, key: HubKey | None = None
    ) -> None:
        self.directory = directory
        self.runner = runner
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # on TCP, only holders of the hub's key are admitted (a free port for ":0")
        self._gate = None if key is None else Gate(key, "TransferQueue key directory")
        if address.endswith(":0"):
            address = address.removesuffix(":0") + ":*"
        self.address = listen(self._sock, address, self._gate)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="flowrl-tq-directory", daemon=True)
        self._thread.start()

    @property
    def refused_peers(self) -> int:
        """Peers without the hub's key that this server refused (on TCP)."""
        return 0 if self._gate is None else self._gate.refused

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            ident, *body = self._sock.recv_multipart()  # ROUTER: the sender's id comes first
            self._sock.send_multipart([ident, _encode_reply(self._answer(body))])
        self._sock.close()

    def _answer(self, body: list[bytes]) -> _Reply:
        """The reply to one request; a malformed one is answered with an error, never
        raised here (the thread serves every process of the hub)."""
        if len(body) != 1:
            return _Reply(error=f"ConfigError: a request is 1 frame, got {len(body)}")
        try:
            call = _DEC_CALL.decode(body[0])
            args = call.args
            if call.method in _ARG_TYPES:
                args = [msgspec.convert(args[0], _ARG_TYPES[call.method])]
            if call.method == "sampler_name":
                return _Reply(value=self.runner.name() if self.runner is not None else "")
            if call.method in _RUNNER_METHODS:
                if self.runner is None:
                    raise ConfigError("this hub has no sampler (tq.init's controller.sampler)")
                return _Reply(value=getattr(self.runner, _RUNNER_METHODS[call.method])(*args))
            return _Reply(value=getattr(self.directory, call.method)(*args))
        except Exception as e:  # answered, never lost: the caller raises it
            return _Reply(error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class RemoteDirectory:
    """A :class:`KeyDirectory` in another process (same methods), one request at a time."""

    def __init__(self, address: str, key: HubKey | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ConfigError(f"a key directory address looks like 'ipc://...', got {address!r}")
        require_key(address, key)  # (on TCP: the hub's)
        self.address = address
        self._lock = threading.Lock()
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        client_options(self._sock, address, key)
        self._sock.connect(address)

    def _call(self, method: Method, *args: Any) -> Any:
        with self._lock:
            self._sock.send(_ENC.encode(_Call(method, list(args))))
            if not self._sock.poll(_RPC_TIMEOUT_MS):
                raise TransportError(
                    f"the TransferQueue key directory at {self.address} did not answer "
                    f"{method!r} within {_RPC_TIMEOUT_MS / 1000:.0f} s; is the process that "
                    "called tq.init() still running?"
                )
            reply = _DEC_REPLY.decode(self._sock.recv())
        if reply.error.startswith(_TASK_GONE):
            raise UnknownTaskError(reply.error.removeprefix(_TASK_GONE))
        if reply.error:
            raise TransportError(f"key directory {method!r} failed: {reply.error}")
        if method in _RESULT_TYPES:
            return msgspec.convert(reply.value, _RESULT_TYPES[method])
        return reply.value

    def lookup(self, partition: str, keys: Sequence[str]) -> list[int]:
        return self._call("lookup", partition, list(keys))

    def bind(self, partition: str, keys: Sequence[str], indices: Sequence[int]) -> list[int]:
        return self._call("bind", partition, list(keys), list(indices))

    def update(
        self,
        partition: str,
        indices: Sequence[int],
        tags: Sequence[dict[str, Any]] | None,
        fields: Sequence[str],
    ) -> tuple[list[dict[str, Any]], list[str]]:
        merged, common = self._call("update", partition, list(indices), tags, list(fields))
        return merged, common

    def describe(self, indices: Sequence[int]) -> tuple[list[dict[str, Any]], list[str]]:
        tags, fields = self._call("describe", list(indices))
        return tags, fields

    def listing(self, partition: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        return self._call("listing", partition)

    def remove(self, partition: str, keys: Sequence[str]) -> list[int]:
        return self._call("remove", partition, list(keys))

    def forget(self, indices: Sequence[int]) -> None:
        self._call("forget", list(indices))

    def remove_partition(self, partition: str) -> None:
        self._call("remove_partition", partition)

    def declare(self, columns: Sequence[Column]) -> None:
        self._call("declare", list(columns))

    def columns(self, names: Sequence[str]) -> list[Column]:
        return self._call("columns", list(names))

    def generation(self) -> int:
        return self._call("generation")

    # the hub's sampler (SamplerRunner's methods), run in the process that called tq.init
    def sample(
        self,
        task: str,
        task_name: str,
        partition: str,
        batch_size: int,
        sampling_config: dict[str, Any],
    ) -> list[int]:
        return self._call("sample", task, task_name, partition, batch_size, sampling_config)

    def clear_cache(self, partition: str) -> None:
        self._call("clear_sampler_cache", partition)

    def sampler_name(self) -> str:
        """The hub's sampler's class name ("" for the default, sequential)."""
        return self._call("sampler_name")

    def wait_changed(self, since: int, timeout: float) -> int:
        """As :meth:`KeyDirectory.wait_changed`, asking every few milliseconds (the server
        thread answers one request at a time, so it never blocks on a wait)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.generation()
            left = deadline - time.monotonic()
            if now != since or left <= 0:
                return now
            time.sleep(min(_WAIT_POLL_S, left))

    def close(self) -> None:
        self._sock.close()
