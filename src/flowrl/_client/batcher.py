"""PutBatcher: a producer's small puts gathered into fewer, larger ones (``hub.put_batcher``).

Every put costs each process it crosses the same fixed work (a request, a commit, an
answer) whatever its size, so a stream of 32-sample puts spends most of its time there:
over zmq a put of 8 x 32 samples moves ~3x the bytes per second of eight 32-sample
``put_async`` (docs/benchmarks.md). A batcher validates each put at once (bad input raises
there and holds nothing), copies its columns into buffers it reuses, and sends what it holds
as one ``put_async`` when ``max_puts`` or ``max_bytes`` is reached, on ``flush()``, on
``close()`` (the end of a ``with`` block) and when a held put's ``result()`` is asked for.
What it holds is not on the hub yet: like a buffered file, flush it when the data must be
seen.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, final

import numpy as np
import pyarrow as pa

from flowrl._client.future import PutFuture
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded
from flowrl._schema.small import one_if_equal
from flowrl._validate import check_seconds
from flowrl.errors import ConfigError, FlowRLError

if TYPE_CHECKING:
    from flowrl._client.base import HubClient

__all__ = ["HeldPut", "PutBatcher"]

log = logging.getLogger("flowrl.client")


@final
class HeldPut:
    """One put of a :class:`PutBatcher`: a future, like ``put_async``'s.

    ``indices`` is None while the batcher holds the put, then the put's samples.
    ``result()`` sends what the batcher holds first (in the batcher's thread), then waits
    for the answer of the put it went out in."""

    __slots__ = ("_batcher", "_error", "_hi", "_lo", "_sent")

    def __init__(self, batcher: PutBatcher, lo: int, hi: int) -> None:
        self._batcher = weakref.ref(batcher)  # (a batcher dropped unflushed sends its puts)
        self._lo, self._hi = lo, hi  # its samples' positions in the put it goes out in
        self._sent: PutFuture | None = None
        self._error: FlowRLError | None = None  # the put it was to go out in was refused

    @property
    def indices(self) -> np.ndarray | None:
        return None if self._sent is None else self._sent.indices[self._lo : self._hi]

    def done(self) -> bool:
        """True once the hub answered (or the put it was to go out in failed to leave)."""
        return self._error is not None or (self._sent is not None and self._sent.done())

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The sample indices once committed; raises the put's error if it failed."""
        if self._sent is None and self._error is None:
            batcher = self._batcher()
            if batcher is None:  # (dropped in another thread, which cannot send for it)
                raise ConfigError("this put was never sent: its PutBatcher was dropped unflushed")
            batcher.send()
        if self._error is not None:
            raise self._error
        assert self._sent is not None
        return self._sent.result(timeout)[self._lo : self._hi]

    def exception(self) -> FlowRLError | None:
        """The put's error once answered (None if it succeeded or is pending)."""
        if self._error is not None:
            return self._error
        return None if self._sent is None else self._sent.exception()


class _Growing:
    """A 1-D buffer appended to and emptied again, its memory reused (fresh pages cost as
    much as the copy into them)."""

    __slots__ = ("buf", "size")

    def __init__(self, dtype: np.dtype) -> None:
        self.buf = np.empty(0, dtype=dtype)
        self.size = 0

    def append(self, values: np.ndarray) -> None:
        end = self.size + values.size
        if end > self.buf.size:
            grown = np.empty(max(end, 2 * self.buf.size), dtype=self.buf.dtype)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        self.buf[self.size : end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self.buf[: self.size]


class _HeldColumn:
    """One column of the puts a batcher holds: numeric values (and offsets of a ragged
    column) appended to reused buffers, or the Arrow arrays of other kinds."""

    __slots__ = ("arrays", "column", "lengths", "nbytes", "offsets", "values")

    def __init__(self, column: Column) -> None:
        self.column = column
        self.values: _Growing | None = None
        self.offsets: _Growing | None = None
        self.arrays: list[pa.Array] = []
        self.nbytes: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []

    def add(self, enc: Encoded) -> None:
        self.nbytes.append(enc.nbytes)
        if enc.lengths is not None:
            self.lengths.append(enc.lengths)
        if enc.buffers is None:
            self.arrays.append(enc.array)
            return
        values = enc.buffers[-1]
        if self.values is None:
            self.values = _Growing(values.dtype)
        if len(enc.buffers) == 2:  # ragged: offsets from 0, then values
            if self.offsets is None:
                self.offsets = _Growing(np.dtype(np.int64))
            if not self.offsets.size:
                self.offsets.append(np.zeros(1, dtype=np.int64))
            self.offsets.append(enc.buffers[0][1:] + self.values.size)
        self.values.append(values)

    def encoded(self, n: int) -> Encoded:
        """The held puts' samples of this column as one write's."""
        nbytes = np.concatenate(self.nbytes)
        lengths = np.concatenate(self.lengths) if self.lengths else None
        if self.values is None:
            array = pa.concat_arrays(self.arrays)
            return Encoded(self.column, n, nbytes, lengths, array=array)
        buffers = [self.values.view()]
        if self.offsets is not None:
            buffers.insert(0, self.offsets.view())
        return Encoded(self.column, n, nbytes, lengths, buffers=buffers)

    def clear(self, reuse: bool) -> None:
        self.arrays, self.nbytes, self.lengths = [], [], []
        for buf in (self.values, self.offsets):
            if buf is not None:
                buf.size = 0
                if not reuse:  # the hub keeps the arrays it was given: new memory next time
                    buf.buf = np.empty(0, dtype=buf.buf.dtype)


@final
class PutBatcher:
    """Gathers one thread's puts of new samples into puts of up to ``max_puts`` puts or
    ``max_bytes`` bytes (see the module docstring; docs/quickstart.md, "Many small puts").

    ``put`` takes what ``hub.put_async`` takes for new samples, less ``indices``, ``seq``
    and ``ack`` (a put to existing samples, an idempotent put or one that acks a claim goes
    through ``hub.put``/``put_async`` itself). Puts whose ``partition``, ``producer``,
    columns or presence of ``groups``/``tokens``/``version`` differ from those held are not
    mixed: what is held is sent first. A put that declares new columns (a hub that infers
    its schema) is sent at once.
    """

    def __init__(
        self,
        hub: HubClient,
        max_puts: int = 8,
        max_bytes: int = 16 << 20,
        timeout: float | None = None,
    ) -> None:
        for name, value in (("max_puts", max_puts), ("max_bytes", max_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"put_batcher() {name} expects an int >= 1, got {value!r}")
        self._hub = hub
        self.max_puts = max_puts
        self.max_bytes = max_bytes
        self._timeout = (
            None
            if timeout is None
            else check_seconds(timeout, "put_batcher() timeout", allow_zero=True)
        )
        self._thread = threading.get_ident()
        self._closed = False
        self._reuse = hub._data.copies_puts  # the transport copies a put before it returns
        self._key: tuple[Any, ...] | None = None
        self._names: tuple[str, ...] = ()  # the held puts' columns
        self._columns: dict[str, _HeldColumn] = {}
        self._held: list[HeldPut] = []
        self._n = 0
        self._bytes = 0
        self._groups: list[np.ndarray] = []
        self._tokens: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []

    @property
    def held(self) -> int:
        """Puts held, not sent yet."""
        return len(self._held)

    def put(
        self,
        data: Mapping[str, Any],
        *,
        partition: str = "",
        groups: Any = None,
        version: Any = None,
        tokens: Any = None,
        producer: str = "",
    ) -> HeldPut:
        """Validate a put of new samples and hold it (sending what is held when full)."""
        self._check_usable("put")
        where = f"PutBatcher.put() from {producer!r}" if producer else "PutBatcher.put()"
        if not isinstance(partition, str):
            raise ConfigError(f"partition must be a str, got {partition!r} in {where}")
        if not isinstance(producer, str):
            raise ConfigError(f"producer must be a str, got {producer!r} in {where}")
        hub = self._hub
        hub._control.raise_policy_error()
        # (owned=False: the columns are copied into the held buffers below)
        encoded, new_columns, n, groups_arr, tokens_arr, versions = hub._encode_put(
            data, None, groups, version, tokens, where, owned=False
        )
        if new_columns:  # (declared only once a put succeeds): not held
            self.send()
            held = HeldPut(self, 0, n)
            held._sent = hub.put_async(
                data,
                partition=partition,
                groups=groups,
                version=version,
                tokens=tokens,
                producer=producer,
                timeout=self._timeout,
            )
            return held
        key = (
            partition,
            producer,
            frozenset(encoded),
            groups_arr is None,
            tokens_arr is None,
            versions is None,
        )
        if self._held and key != self._key:
            self.send()
        if not self._held:
            self._key, self._names = key, tuple(encoded)
        for name, enc in encoded.items():
            held_column = self._columns.get(name)
            if held_column is None:
                held_column = self._columns[name] = _HeldColumn(enc.column)
            held_column.add(enc)
            self._bytes += int(enc.nbytes.sum())
        if groups_arr is not None:
            self._groups.append(groups_arr)
        if tokens_arr is not None:
            self._tokens.append(tokens_arr)
        if versions is not None:
            per_sample = versions if isinstance(versions, np.ndarray) else np.full(n, versions)
            self._versions.append(per_sample.astype(np.int64, copy=False))
        held = HeldPut(self, self._n, self._n + n)
        self._held.append(held)
        self._n += n
        if len(self._held) >= self.max_puts or self._bytes >= self.max_bytes:
            self.send()
        return held

    def send(self) -> None:
        """Send what is held as one ``put_async`` (nothing if nothing is held)."""
        self._check_thread("send")
        if not self._held:
            return
        held, n = self._held, self._n
        partition, producer = self._key[0], self._key[1]  # type: ignore[index]
        encoded = {name: self._columns[name].encoded(n) for name in self._names}
        groups = np.concatenate(self._groups) if self._groups else None
        tokens = np.concatenate(self._tokens) if self._tokens else None
        versions: int | np.ndarray | None = None
        if self._versions:
            versions = one_if_equal(np.concatenate(self._versions))
        try:
            sent = self._hub._put_async_encoded(
                encoded, n, partition, groups, versions, tokens, producer, self._timeout
            )
        except BaseException as exc:
            error = (
                exc if isinstance(exc, FlowRLError) else FlowRLError(f"send interrupted: {exc!r}")
            )
            for put in held:
                put._error = error
            raise
        finally:
            self._reset()
        for put in held:
            put._sent = sent

    def flush(self, timeout: float | None = None) -> None:
        """Send what is held, then wait until every put of this thread is answered (as
        ``hub.flush``: raises the first failure nobody was told about)."""
        self.send()
        self._hub.flush(timeout)

    def close(self) -> None:
        """Flush; the batcher takes no more puts."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True

    def __enter__(self) -> PutBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._abandon("dropped")

    def _abandon(self, why: str) -> None:
        """Send what is held when nobody flushed: the batcher was dropped or its hub is
        closing (in its own thread; from another, the puts are lost, and said so)."""
        try:
            held = 0 if self._closed else len(self._held)
            if not held:
                return
            if threading.get_ident() == self._thread:
                with contextlib.suppress(FlowRLError):
                    self.send()
                    return
            log.warning(
                "a PutBatcher %s holding %d puts that were never sent (flush() it, or use "
                "it in a with block)",
                why,
                held,
            )
        except Exception:  # (interpreter shutdown: modules half gone)
            return

    def _reset(self) -> None:
        for column in self._columns.values():
            column.clear(self._reuse)
        self._held, self._n, self._bytes = [], 0, 0
        self._groups, self._tokens, self._versions = [], [], []

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise ConfigError(f"PutBatcher.{what}() after close(): make a new hub.put_batcher()")
        self._check_thread(what)

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise ConfigError(
                f"PutBatcher.{what}() must be called in the thread that made the batcher "
                "(its puts are that thread's put_async); make one batcher per thread"
            )
