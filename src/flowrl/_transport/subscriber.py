"""A zmq client's relay of the controller's event stream to its local subscribers.

The controller publishes every event, in order, on a PUB socket, under a topic naming its
kind (:data:`EVENT_TOPICS`); a relay subscribes (handshaking with ``PublishHello`` markers,
since PUB/SUB drops messages until the connection is up) and a pump thread appends each
event that a local subscriber wants to a local :class:`EventLog`, which runs the client's
observers and policies. Events no local subscriber wants are not even decoded.
"""

from __future__ import annotations

import threading
import time

import zmq

from flowrl._controller.eventlog import EventLog
from flowrl._transport import wire
from flowrl._transport.auth import client_options
from flowrl._transport.session import Session
from flowrl._transport.sockio import poll_in, recv_parts
from flowrl.errors import TransportError
from flowrl.events import EVENT_TYPES, event_decoder

__all__ = ["EVENT_TOPICS", "EventRelay"]

#: The PUB topic of each kind of event: ``e`` and its tag.
EVENT_TOPICS: dict[type, bytes] = {
    cls: f"e{cls.__struct_config__.tag}".encode() for cls in EVENT_TYPES
}
_KIND_OF_TOPIC = {topic: cls for cls, topic in EVENT_TOPICS.items()}


class EventRelay:
    """The controller's events, relayed into ``log`` by a pump thread (started at once)."""

    def __init__(self, session: Session, events_address: str) -> None:
        self.log = EventLog()
        self._session = session
        self._hello = threading.Condition()
        self._hello_seen = 0
        self._stop = threading.Event()
        sub = session.zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        client_options(sub, events_address, session.key)
        sub.connect(events_address)
        # PUB/SUB drops messages until the connection is up: handshake before returning.
        token = next(session.counter)
        for _ in range(100):
            session.call(None, wire.PublishHello(token=token))
            if sub.poll(50) and _drain_until_hello(sub, token):
                break
        else:
            sub.close()
            raise TransportError("could not subscribe to the hub's event stream")
        self._thread = threading.Thread(
            target=self._pump, args=(sub,), name="flowrl-sub", daemon=True
        )
        self._thread.start()

    def _pump(self, sub: zmq.Socket) -> None:
        subs = [sub]
        while not self._stop.is_set():
            if not poll_in(subs, 100):
                continue
            topic, body = recv_parts(sub)
            kind = _KIND_OF_TOPIC.get(topic)
            if kind is not None:
                wanted = self.log.wanted
                if wanted is None or kind in wanted:
                    self.log.append(event_decoder.decode(body))
            elif topic == b"h":
                with self._hello:
                    self._hello_seen = max(self._hello_seen, int.from_bytes(body, "little"))
                    self._hello.notify_all()
        sub.close()

    def flush(self, timeout: float | None) -> bool:
        """Wait until subscribers received every event the controller had logged at the call.

        A marker sent through the ordered event stream proves every earlier event arrived.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        token = next(self._session.counter)
        self._session.call(None, wire.PublishHello(token=token))
        with self._hello:
            if not self._hello.wait_for(lambda: self._hello_seen >= token, timeout=timeout):
                return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.log.flush(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.log.close()


def _drain_until_hello(sub: zmq.Socket, token: int) -> bool:
    want = token.to_bytes(8, "little")
    while sub.poll(0):
        topic, body = sub.recv_multipart()
        if topic == b"h" and body == want:
            return True
    return False
