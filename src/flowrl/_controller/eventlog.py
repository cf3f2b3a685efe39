"""The controller's event log and its subscribers.

Appending is cheap and happens under the controller's lock; delivery happens on one
dispatcher thread, in log order, so a slow subscriber never stalls the hub. Observers fail
soft: one that raises is logged and unsubscribed. Policies registered with ``strict=True``
fail loudly: their exception is kept and re-raised by :meth:`EventLog.check`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from flowrl.events import Event

__all__ = ["EventLog", "Subscription"]

log = logging.getLogger("flowrl.events")


class Subscription:
    """Handle returned by ``subscribe``; call :meth:`cancel` to stop receiving events.
    ``kinds``: the event classes it receives (None: every event)."""

    def __init__(
        self,
        log_: EventLog,
        callback: Callable[[Event], Any],
        strict: bool,
        kinds: frozenset[type] | None = None,
    ) -> None:
        self._log = log_
        self.callback = callback
        self.strict = strict
        self.kinds = kinds
        self.active = True

    def cancel(self) -> None:
        self._log._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class EventLog:
    """Bounded in-memory history of events plus asynchronous fan-out to subscribers."""

    def __init__(self, history: int = 65536) -> None:
        self.history: collections.deque[Event] = collections.deque(maxlen=history)
        self.seq = 0
        self._pending: collections.deque[Event] = collections.deque()
        self._subs: list[Subscription] = []
        self._cond = threading.Condition()
        self._delivered = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.policy_error: BaseException | None = None
        # Synchronous sinks (the counters, the journal, the zmq PUB relay), called in order
        # on append.
        self.sinks: list[Callable[[Event], None]] = []
        # The event classes some subscriber receives (None: every event): what a relay of a
        # remote controller's events has to decode at all.
        self.wanted: frozenset[type] | None = frozenset()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def append(self, event: Event) -> None:
        self.seq = event.seq  # events relayed from a remote controller carry their own seq
        self.history.append(event)
        for sink in self.sinks:
            sink(event)
        if self._subs:
            with self._cond:
                self._pending.append(event)
                self._cond.notify()
        else:
            self._delivered = event.seq

    def subscribe(
        self,
        callback: Callable[[Event], Any],
        *,
        strict: bool = False,
        kinds: frozenset[type] | None = None,
    ) -> Subscription:
        sub = Subscription(self, callback, strict, kinds)
        with self._cond:
            self._subs.append(sub)
            self._update_wanted()
            self._delivered = self.seq  # a new subscriber sees events from now on
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flowrl-events", daemon=True)
                self._thread.start()
        return sub

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Wait until every event appended so far was delivered; False on timeout."""
        target = self.seq
        with self._cond:
            return self._cond.wait_for(
                lambda: self._delivered >= target or not self._subs, timeout=timeout
            )

    def check(self) -> None:
        """Re-raise the first exception raised by a strict (policy) subscriber."""
        if self.policy_error is not None:
            raise self.policy_error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _remove(self, sub: Subscription) -> None:
        with self._cond:
            sub.active = False
            if sub in self._subs:
                self._subs.remove(sub)
                self._update_wanted()
            self._cond.notify_all()

    def _update_wanted(self) -> None:
        if any(sub.kinds is None for sub in self._subs):
            self.wanted = None
        else:
            self.wanted = frozenset().union(*(sub.kinds or () for sub in self._subs))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                batch = list(self._pending)
                self._pending.clear()
                subs = list(self._subs)
            for event in batch:
                for sub in subs:
                    if sub.active and (sub.kinds is None or type(event) in sub.kinds):
                        self._deliver(sub, event)
            with self._cond:
                self._delivered = batch[-1].seq
                self._cond.notify_all()

    def _deliver(self, sub: Subscription, event: Event) -> None:
        try:
            sub.callback(event)
        except Exception as exc:
            if sub.strict:
                if self.policy_error is None:
                    self.policy_error = exc
                log.error("policy subscriber %r raised on %s", sub.callback, type(event).__name__)
            else:
                log.warning(
                    "observer %r raised %r on %s; unsubscribing it",
                    sub.callback,
                    exc,
                    type(event).__name__,
                    exc_info=True,
                )
            self._remove(sub)
