"""A zmq client's ``put_async`` requests in flight, per thread, until they are settled.

A put_async is sent and its :class:`PutFuture` returned at once; the answer arrives on the
sending thread's sockets, read when that thread waits for this put (``result``,
``flush``) or for anything else (the session hands it replies it does not wait for).
A refused put is cleaned up at the next safe point, never inside another request's
wait: the bytes its unit stored are discarded and its reserved indices given back, or,
for a put whose pooled indices the controller no longer held, it is made again.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flowrl._client.future import PutFuture
from flowrl._transport import wire
from flowrl._transport.session import MAY_HAVE_LANDED, NoAnswer, Session
from flowrl.errors import DuplicatePut, FlowRLError, Timeout, UnknownIndexError

__all__ = ["PUTS_IN_FLIGHT", "PutsInFlight"]

#: put_async requests a thread may have unanswered (``RemoteHub.max_puts_in_flight``).
PUTS_IN_FLIGHT = 64


class _Sent:
    """A put_async that was sent: where to, and how to undo or redo it if refused."""

    __slots__ = ("again", "asked", "columns", "future", "new", "rid", "unit")

    def __init__(
        self,
        unit: int,
        rid: bytes,
        columns: tuple[str, ...],
        new: bool,
        again: Callable[[], np.ndarray] | None,
        asked: int,
    ) -> None:
        self.future: PutFuture  # (made with its wait, which names this record)
        self.unit, self.rid = unit, rid
        self.columns, self.new = columns, new
        self.again = again  # makes the put again (synchronously): its new indices
        self.asked = asked  # indices its commit was asked to reserve for the next puts


class PutsInFlight:
    """Each thread's unanswered put_async (at most ``limit``; the next waits for the
    oldest) and the refused ones not yet cleaned up or reported.

    ``discard(unit, indices, columns)`` and ``abort(indices)`` free what a refused new
    put left behind; ``reserved(asked, reply)`` takes the answer of a put whose commit was
    asked to reserve ``asked`` indices for the next puts (``wire.Reserved`` if it did)."""

    def __init__(
        self,
        session: Session,
        discard: Callable[[int, np.ndarray, tuple[str, ...]], None],
        abort: Callable[[np.ndarray], None],
        reserved: Callable[[int, Any], None],
    ) -> None:
        self._session = session
        self._discard = discard
        self._abort = abort
        self._reserved = reserved
        self._local = threading.local()
        self.limit = PUTS_IN_FLIGHT
        session.on_stray = self._answered

    def _pending(self) -> dict[bytes, _Sent]:
        """This thread's unanswered put_async, oldest first."""
        pending: dict[bytes, _Sent] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = {}
        return pending

    def _refused(self) -> list[_Sent]:
        """This thread's refused put_async not yet cleaned up or reported."""
        failed: list[_Sent] | None = getattr(self._local, "failed", None)
        if failed is None:
            failed = self._local.failed = []
        return failed

    def any_pending(self) -> bool:
        return bool(getattr(self._local, "pending", None))

    def take_answered(self) -> None:
        """Settle this thread's put_async the controller answered already (no waiting)."""
        if self.any_pending():
            self._session.take_ready(None)

    def send(
        self,
        unit: int,
        msg: Any,
        frames: Sequence[Any],
        indices: np.ndarray,
        columns: tuple[str, ...],
        *,
        new: bool,
        again: Callable[[], np.ndarray] | None,
        asked: int = 0,
    ) -> PutFuture:
        """Send a write-and-commit to ``unit`` and return its future (``again``: how to
        make the put again should its pooled indices be gone; ``asked``: indices its
        commit reserves for the next puts)."""
        pending = self._pending()
        while len(pending) >= self.limit:
            self._wait(next(iter(pending.values())), None)
        rid = self._session.send(unit, msg, frames)
        sent = _Sent(unit, rid, columns, new, again, asked)
        sent.future = PutFuture(indices, functools.partial(self._wait_future, sent))
        pending[rid] = sent
        return sent.future

    def _answered(self, rid: bytes, reply: Any) -> None:
        """A reply the session read while waiting for something else."""
        sent = self._pending().pop(rid, None)
        if sent is not None:
            error = wire.exception_of(reply) if type(reply) is wire.Error else None
            self._settle(sent, error, reply)

    def _settle(self, sent: _Sent, error: FlowRLError | None, reply: Any = None) -> None:
        """An answered put: done, or refused (its bytes and indices are freed at the next
        safe point, ``_clean_failed``: not here, inside another request's wait)."""
        if sent.asked:
            asked, sent.asked = sent.asked, 0
            self._reserved(asked, reply)
        if error is None:
            sent.again = None  # (its copy of the put's bytes: the future outlives it)
            sent.future._succeed()
        else:
            sent.future._fail(error)
            self._refused().append(sent)

    def _wait_future(self, sent: _Sent, fut: PutFuture, timeout: float | None) -> None:
        self._wait(sent, timeout)

    def _wait(self, sent: _Sent, timeout: float | None) -> None:
        pending = self._pending()
        if sent.rid in pending:
            error: FlowRLError | None = None
            try:
                session = self._session
                wait = session.reply_wait(sent.unit, or_controller=True)
                wait = wait if timeout is None else timeout
                reply, _ = self._session.recv(sent.unit, sent.rid, wait, or_controller=True)
            except NoAnswer as exc:
                if timeout is not None:  # the caller's limit: the put stays pending
                    raise Timeout(
                        f"put_async of samples {sent.future.indices[:4].tolist()}... was not "
                        f"answered within {timeout}s"
                    ) from None
                # Nothing answered this put for rpc_timeout: each other put pending in this
                # thread was sent before the wait began and went unanswered as long. They
                # fail together, not one rpc_timeout after another.
                exc.add_note(MAY_HAVE_LANDED)
                for other in list(pending.values()):
                    del pending[other.rid]
                    self._settle(other, exc)
                self._clean_failed()
                return
            except FlowRLError as exc:  # the hub refused this put (or the socket failed)
                error, reply = exc, None
            del pending[sent.rid]
            self._settle(sent, error, reply)
        self._clean_failed()

    def _clean_failed(self) -> None:
        """At a safe point (not inside another request's wait): free what refused puts
        left (bytes a unit stored, indices they reserved); a new put whose pooled indices
        the controller no longer held is made again, synchronously, as ``put`` does."""
        failed = self._refused()
        for sent in failed:  # (a discard's wait may append: it is seen too)
            fut = sent.future
            # An unanswered put may have been committed (by a controller that died after
            # journaling it): its bytes stay, a reservation never committed expires.
            if sent.new and sent.columns and not isinstance(fut._error, NoAnswer):
                columns, sent.columns = sent.columns, ()  # freed once
                with contextlib.suppress(FlowRLError):
                    self._discard(sent.unit, fut.indices, columns)
                    self._abort(fut.indices)
            if isinstance(fut._error, DuplicatePut):  # a re-sent idempotent put: the first
                fut._redone(np.array(fut._error.indices, dtype=np.int64))  # one's answer
            again, sent.again = sent.again, None
            if again is not None and isinstance(fut._unobserved_error, UnknownIndexError):
                try:
                    indices = again()
                except FlowRLError as exc:
                    fut._fail(exc)
                else:
                    fut._redone(indices)
        self._local.failed = [s for s in failed if s.future._unobserved_error is not None]

    def raise_failed(self) -> None:
        """Raise the first failed put_async of this thread that nobody was told about."""
        self._clean_failed()
        failed, self._local.failed = self._refused(), []
        if failed:
            errors = [s.future.exception() for s in failed]  # each is reported now, once
            error = errors[0]
            assert error is not None
            more = f"; {len(failed) - 1} later ones failed too" if len(failed) > 1 else ""
            error.add_note(
                f"raised by an earlier put_async (samples "
                f"{failed[0].future.indices[:4].tolist()}) whose future was not waited for{more}"
            )
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every put_async of this thread is answered, then raise_failed."""
        pending = self._pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            sent = next(iter(pending.values()))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait(sent, left)
        self.raise_failed()
