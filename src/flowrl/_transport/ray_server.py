"""The Ray actor that hosts one hub server (see ray_hub.py): imported in the actor only."""

from __future__ import annotations

import threading

import msgspec
import zmq

from flowrl._transport.controller_server import ControllerServer
from flowrl._transport.specs import ControllerSpec, ServerSpec
from flowrl._transport.unit_server import UnitServer

__all__ = ["ServerHost"]


class ServerHost:
    """The body of the Ray actor that hosts one hub server, serving in a thread."""

    def start(self, spec_json: bytes) -> list[str]:
        """Bind and start serving; returns the bound addresses (controller: its address and
        its events address; storage unit: its address and its control address)."""
        spec = msgspec.json.decode(spec_json, type=ServerSpec)
        fields = msgspec.structs.asdict(spec)
        server: ControllerServer | UnitServer
        if isinstance(spec, ControllerSpec):
            server = ControllerServer(**fields)
            server.events_address = _bound(server.pub)  # what Hello tells the clients
            bound = [_bound(server.sock), server.events_address]
        else:
            server = UnitServer(**fields)
            bound = [_bound(server.sock), _bound(server.control)]
        threading.Thread(target=server.serve, name="flowrl-server", daemon=True).start()
        return bound


def _bound(sock: zmq.Socket) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
