"""Idempotent puts: each producer's recent sequence numbers and the samples they made.

A put that names its producer and a sequence number (``put(..., producer=, seq=)``) lands
once, as with Kafka's idempotent producer: a put re-sent with a ``(producer, seq)`` the
hub already committed — a client's retry, or a restarted producer re-sending the puts it
never saw answered — is refused with :class:`~flowrl.errors.DuplicatePut` carrying the
first put's indices, which the client returns as that put's answer.

Puts of one producer may commit out of order (``put_async`` to several storage units),
so the controller remembers the set of committed sequence numbers, not a high-water
mark: the last :data:`PRODUCER_WINDOW` of each producer, in commit order. A sequence
number older than every one remembered that is not among them is refused with a
:class:`~flowrl.errors.ConfigError`: the hub can no longer tell whether it landed, and
guessing would lose or duplicate a put.

The window is controller state like any other: commits record into it through the same
code when the journal is replayed (the ``Put`` event carries ``seq``), and a snapshot
keeps it (:meth:`Producers.to_records`), so deduplication survives a controller restart.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import numpy as np

from flowrl.errors import ConfigError, DuplicatePut

__all__ = ["PRODUCER_WINDOW", "ProducerRecord", "Producers"]

#: Committed sequence numbers remembered per producer (more than the puts one producer
#: has in flight: ``max_puts_in_flight`` per thread).
PRODUCER_WINDOW = 1024


class ProducerRecord(msgspec.Struct, frozen=True, array_like=True):
    """One producer's window in a snapshot: its remembered puts in commit order, each as
    ``(seq, first, count)``, a run of ``count`` indices from ``first``, or ``first = -1``
    for a scattered put whose indices are in ``scattered``."""

    name: str
    forgotten: int
    seqs: bytes  # int64 each
    firsts: bytes
    counts: bytes
    scattered: dict[int, bytes] = {}


def _compact(indices: np.ndarray) -> range | np.ndarray:
    """A put's indices as a range when they are consecutive (nearly always: the table
    allocates them so), else as they are."""
    n = int(indices.size)
    if n and int(indices[-1]) - int(indices[0]) == n - 1 and (np.diff(indices) == 1).all():
        return range(int(indices[0]), int(indices[0]) + n)
    return indices.copy()


class _Window:
    __slots__ = ("forgotten", "puts")

    def __init__(self) -> None:
        self.puts: dict[int, range | np.ndarray] = {}  # seq -> indices, in commit order
        self.forgotten = -1  # the newest seq dropped from the window


class Producers:
    """Every producer's window (see the module docstring)."""

    def __init__(self, window: int = PRODUCER_WINDOW) -> None:
        self.window = window
        self._by_name: dict[str, _Window] = {}
        self.duplicates = 0  # re-sent puts refused (not state: not journaled)

    def check(self, producer: str, seq: int) -> None:
        """Raise :class:`DuplicatePut` when ``(producer, seq)`` was committed, and
        :class:`ConfigError` when it is too old to tell."""
        win = self._by_name.get(producer)
        if win is None:
            return
        done = win.puts.get(seq)
        if done is not None:
            self.duplicates += 1
            raise DuplicatePut(
                f"put(producer={producer!r}, seq={seq}) was committed before, as samples "
                f"{[int(i) for i in done[:4]]}{'...' if len(done) > 4 else ''}; the re-sent put is "
                "dropped",
                indices=tuple(int(i) for i in done),
            )
        if seq <= win.forgotten:
            raise ConfigError(
                f"put(producer={producer!r}, seq={seq}): the hub remembers the last "
                f"{self.window} puts of each producer, and seq {seq} is older than all of "
                "them, so it cannot tell whether that put landed; re-send only recent "
                "puts, numbered in the order they are made"
            )

    def record(self, producer: str, seq: int, indices: np.ndarray) -> None:
        """Remember a committed put (after :meth:`check` passed)."""
        win = self._by_name.get(producer)
        if win is None:
            win = self._by_name[producer] = _Window()
        win.puts[seq] = _compact(indices)
        if len(win.puts) > self.window:
            oldest = next(iter(win.puts))
            del win.puts[oldest]
            win.forgotten = max(win.forgotten, oldest)

    def __len__(self) -> int:
        return len(self._by_name)

    # -- snapshots ------------------------------------------------------------------------
    def to_records(self) -> list[ProducerRecord]:
        records = []
        for name, win in self._by_name.items():
            n = len(win.puts)
            seqs = np.fromiter(win.puts, dtype=np.int64, count=n)
            firsts = np.empty(n, dtype=np.int64)
            counts = np.empty(n, dtype=np.int64)
            scattered = {}
            for i, (seq, idx) in enumerate(win.puts.items()):
                counts[i] = len(idx)
                if isinstance(idx, range):
                    firsts[i] = idx.start
                else:
                    firsts[i] = -1
                    scattered[seq] = idx.tobytes()
            records.append(
                ProducerRecord(
                    name,
                    win.forgotten,
                    seqs.tobytes(),
                    firsts.tobytes(),
                    counts.tobytes(),
                    scattered,
                )
            )
        return records

    def restore(self, records: Iterable[ProducerRecord]) -> None:
        for rec in records:
            win = self._by_name[rec.name] = _Window()
            win.forgotten = rec.forgotten
            seqs, firsts, counts = (
                np.frombuffer(b, dtype=np.int64).tolist()
                for b in (rec.seqs, rec.firsts, rec.counts)
            )
            for seq, first, count in zip(seqs, firsts, counts, strict=True):
                win.puts[seq] = (
                    range(first, first + count)
                    if first >= 0
                    else np.frombuffer(rec.scattered[seq], dtype=np.int64).copy()
                )
