"""Several small messages to one peer as one zmq message: a bundle.

A server working through a backlog (a storage unit's writes in a stream of puts, the
controller's commits) hands on or answers each request. Sent one by one, every message
costs a wakeup of both processes' zmq threads and of the receiver, a few syscalls each: on
a busy machine as much CPU as handling a commit. Messages for one peer that are ready
together go as one multipart message instead: an empty frame where a request id would
be (request ids are never empty), then (request id, body) pairs. A lone message goes as
it always did, so an idle hub answers as soon as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

__all__ = ["BUNDLE", "Outbox", "pairs"]

#: The first frame of a bundle, where a single message has its request id.
BUNDLE = b""


class Outbox:
    """Messages held for their peers until ``drain``: each peer's, in order, as the frames
    of one message (a bundle when there are several), peers in the order first named."""

    __slots__ = ("_held", "_notes", "size")

    def __init__(self) -> None:
        self._held: dict[Hashable, list[Any]] = {}
        self._notes: dict[Hashable, list[Any]] = {}
        self.size = 0  # messages held

    def add(self, peer: Hashable, rid: bytes, body: bytes, note: Any = None) -> None:
        """Hold a message (``note``: what its sender needs should the send fail)."""
        held = self._held.get(peer)
        if held is None:
            self._held[peer], self._notes[peer] = [rid, body], [note]
        else:
            held += (rid, body)
            self._notes[peer].append(note)
        self.size += 1

    def drain(self) -> Iterator[tuple[Any, list[Any], list[Any]]]:
        """(peer, frames, notes) per peer, emptying the outbox."""
        held, notes = self._held, self._notes
        self._held, self._notes, self.size = {}, {}, 0
        for peer, frames in held.items():
            yield peer, frames if len(frames) == 2 else [BUNDLE, *frames], notes[peer]


def pairs(frames: list[Any]) -> Iterator[tuple[Any, Any]]:
    """The (request id, body) pairs of a bundle's frames after its first (a trailing odd
    frame is not a message: skipped)."""
    for i in range(1, len(frames) - 1, 2):
        yield frames[i], frames[i + 1]
