"""PutFuture: a put whose answer is collected later (``HubClient.put_async``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import final

import numpy as np

from flowrl.errors import ConfigError, FlowRLError

__all__ = ["PutFuture"]


@final
class PutFuture:
    """A put that was sent; ``result()`` waits for the hub's answer.

    ``indices`` are known at once (a new put's indices are reserved before it is sent).
    ``result()`` returns them once the bytes are stored and committed, or raises the put's
    error (the hub is then as if the put never happened). Only the thread that made the put
    can wait for it: the answer arrives on that thread's sockets.
    """

    __slots__ = ("_done", "_error", "_observed", "_wait", "indices", "thread")

    def __init__(
        self,
        indices: np.ndarray,
        wait: Callable[[PutFuture, float | None], None] | None = None,
    ) -> None:
        self.indices = indices
        self._wait = wait  # the client's: waits for the answer, then settles any failure
        self._done = wait is None
        self._error: FlowRLError | None = None
        self._observed = False
        self.thread = threading.get_ident()

    @classmethod
    def completed(cls, indices: np.ndarray) -> PutFuture:
        return cls(indices)

    def done(self) -> bool:
        """True once the hub answered (stored and committed, or refused)."""
        return self._done

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The sample indices, once committed; raises the put's error if it failed, or
        :class:`~flowrl.errors.Timeout` (the put still pending) after ``timeout`` seconds."""
        if self._wait is not None and threading.get_ident() == self.thread:
            if not self._done or self._error is not None:
                self._wait(self, timeout)  # (a refused put may be made again: RemoteHub)
        elif not self._done:
            raise ConfigError(
                "PutFuture.result() must be called in the thread that made the put "
                "(its answer arrives on that thread's sockets); call hub.flush() there"
            )
        return self._value()

    def exception(self) -> FlowRLError | None:
        """The put's error once answered (None if it succeeded or is still pending)."""
        if self._error is not None:
            self._observed = True
        return self._error

    # -- for the client that resolves it ----------------------------------------------------
    def _succeed(self) -> None:
        self._done = True

    def _redone(self, indices: np.ndarray) -> None:
        """Made again (synchronously) under new indices after a refusal."""
        self.indices = indices
        self._error = None
        self._done = True

    def _fail(self, error: FlowRLError) -> None:
        self._done = True
        self._error = error

    def _value(self) -> np.ndarray:
        if self._error is not None:
            self._observed = True
            raise self._error
        return self.indices

    @property
    def _unobserved_error(self) -> FlowRLError | None:
        return None if self._observed else self._error
