"""Claim-ahead: a thread that claims and reads the next micro-batches while the consumer
works on this one, and acks the ones it finished.

A consumer that claims, reads and acks one micro-batch at a time waits three round trips
between micro-batches; over processes on a busy machine each is a wait for a scheduler
slice as well. A :class:`Prefetcher` holds up to ``depth`` leased batches ready (already
read), so ``take`` returns at once while the stream keeps up, and sends the consumer's
acks itself. It claims every batch it has room for in one request
(``HubClient.claim_batches``: each its own lease) and reads them together
(``HubClient.get_batches``), so a consumer of small micro-batches pays one round trip for
several.

Exactly-once holds as without it: a batch counts as consumed only when the consumer
acks it (``ack``, sent in order by the thread; a failed ack is raised by the consumer's
next call), and ``close`` releases the leases of the batches it never handed out, so the
hub delivers them again, first in line. A process that dies leaves its leases to expire,
as it would without prefetching.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from flowrl._client.base import HubClient
from flowrl._client.batch import Batch
from flowrl._controller.meta import BatchMeta
from flowrl.errors import LeaseError

__all__ = ["Prefetcher", "Stopped"]

#: What the thread puts after the last batch: the stream ended.
_END = object()


class Stopped(Exception):
    """Raised by the claim function once the prefetcher is closing (``stopping``)."""


class Prefetcher:
    """Claims ahead with ``claim(room)`` (1 to ``room`` BatchMetas, each its own lease;
    raises StopIteration at the end of the stream, Stopped once ``stopping`` is set, or an
    error the consumer should see) and reads them with ``hub.get_batches``."""

    def __init__(
        self,
        hub: HubClient,
        claim: Callable[[int], list[BatchMeta]],
        depth: int,
        ack: Callable[[BatchMeta], None],
    ) -> None:
        self._hub = hub
        self._claim = claim
        self._ack_now = ack
        self._depth = depth
        self._cond = threading.Condition()
        self._ready: collections.deque[Any] = collections.deque()  # (meta, batch), errors
        self._acks: list[BatchMeta] = []
        self._unsent = 0  # acks asked for and not sent yet (queued or being sent)
        self._ack_error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """Whether ``close`` asks the thread to stop (its claim should raise Stopped)."""
        return self._stopping

    def take(self) -> tuple[BatchMeta, Batch]:
        """The next batch (waiting for it); raises what the claim raised (StopIteration at
        the end of the stream) once the batches before it were taken."""
        self._raise_ack_error()
        with self._cond:
            self._start()
            while not self._ready:
                self._cond.wait()
            item = self._ready.popleft()
            self._cond.notify_all()
        if isinstance(item, tuple):
            return item
        self._join()  # the thread ended with this: a next take starts another
        if item is _END:
            raise StopIteration
        raise item

    def ack(self, meta: BatchMeta) -> None:
        """Ack ``meta`` from the thread (in order; a failure is raised by the next call)."""
        self._raise_ack_error()
        with self._cond:
            self._acks.append(meta)
            self._unsent += 1
            self._cond.notify_all()
            running = self._thread is not None
        if not running:
            self._flush_acks()

    def wait_acked(self) -> None:
        """Return once every ack asked for so far was sent (a checkpoint taken then
        covers them: a crash after it cannot deliver them again); raises a failed one."""
        self._flush_acks()  # (what the thread has not taken yet goes from here)
        with self._cond:
            while self._unsent:
                self._cond.wait()
        self._raise_ack_error()

    def close(self) -> None:
        """Stop the thread, send the acks it still holds, give back every batch claimed
        and not taken (their samples are delivered again, first in line)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._join()
        self._flush_acks()
        with self._cond:
            ready, self._ready = list(self._ready), collections.deque()
            self._stopping = False
        for item in reversed(ready):  # back to the front of the queue, in claim order
            if isinstance(item, tuple):
                with contextlib.suppress(LeaseError):  # expired: back already
                    self._hub.release(item[0])
        self._raise_ack_error()

    # -- the thread ----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="flowrl-prefetch", daemon=True)
            self._thread.start()

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._acks and len(self._ready) >= self._depth:
                    self._cond.wait()
                if self._stopping:
                    return
                room = self._depth - len(self._ready)
            self._flush_acks()
            if room <= 0:
                continue
            items = self._claim_and_read(room)
            if items is None:
                return
            with self._cond:
                self._ready.extend(items)
                self._cond.notify_all()
            if not isinstance(items[-1], tuple):
                return

    def _claim_and_read(self, room: int) -> list[Any] | None:
        """Up to ``room`` (meta, batch) pairs, or the end of the stream or an error as the
        last item (None: stopped)."""
        try:
            metas = self._claim(room)
        except Stopped:
            return None
        except StopIteration:
            return [_END]
        except BaseException as exc:  # the consumer raises it, in order
            return [exc]
        try:
            return list(zip(metas, self._hub.get_batches(metas), strict=True))
        except BaseException as exc:
            for meta in metas:
                with contextlib.suppress(Exception):
                    self._hub.release(meta)
            return [exc]

    def _flush_acks(self) -> None:
        with self._cond:
            acks, self._acks = self._acks, []
        for meta in acks:
            error = None
            try:
                self._ack_now(meta)
            except BaseException as exc:
                error = exc
            with self._cond:
                self._unsent -= 1
                if self._ack_error is None:
                    self._ack_error = error
                self._cond.notify_all()

    def _raise_ack_error(self) -> None:
        with self._cond:
            error, self._ack_error = self._ack_error, None
        if error is not None:
            raise error
