"""The Ray actor that hosts one hub server (see ray_hub.py): imported in the actor only."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

from flowrl._transport import wire
from flowrl._transport.controller_server import ControllerServer
from flowrl._transport.specs import ControllerSpec, ServerSpec
from flowrl._transport.unit_server import UnitServer
from flowrl.errors import ConfigError

__all__ = ["ServerHost"]


class ServerHost:
    """The body of the Ray actor that hosts one hub server, serving in a thread."""

    def start(self, spec_json: bytes) -> list[str]:
        """Bind and start serving; returns the bound addresses (controller: its address and
        its events address; storage unit: its address and its control address)."""
        spec = msgspec.json.decode(spec_json, type=ServerSpec)
        fields = msgspec.structs.asdict(spec)
        server: _LocalityController | UnitServer
        if isinstance(spec, ControllerSpec):
            server = _LocalityController(**fields)
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


class _LocalityController(ControllerServer):
    """The controller server, reserving new samples on the storage unit a producer asks for
    (one on its own node)."""

    def _try(self, msg: Any) -> Any:
        if isinstance(msg, wire.Reserve) and msg.unit is not None:
            if msg.unit >= self.ctl.n_units:
                raise ConfigError(
                    f"storage unit {msg.unit} does not exist (have {self.ctl.n_units})"
                )
            self.ctl._next_unit = msg.unit  # the unit Controller.reserve takes next
        return super()._try(msg)
