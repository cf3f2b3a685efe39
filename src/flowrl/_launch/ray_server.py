"""The Ray actor that hosts one hub server (see ray_hub.py): imported in the actor only.

The constructor serves. Ray re-runs it, with the same spec, when it restarts the actor
after its process died (``max_restarts`` of a journaled hub): the server binds the same
addresses again, so clients reconnect by themselves, and recovers from the journal.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import msgspec
import zmq

from flowrl._launch.ports import is_free
from flowrl._launch.processes import as_restarted
from flowrl._launch.specs import ControllerSpec, ServerSpec
from flowrl._transport.auth import bound_address
from flowrl._transport.controller_server import ControllerServer
from flowrl._transport.unit_server import UnitServer

__all__ = ["BIND_WAIT_S", "ServerHost"]

#: How long a restarted server waits for its ports to be free again before it gives up.
BIND_WAIT_S = 30.0


class ServerHost:
    """The body of the Ray actor that hosts one hub server, serving in a thread.

    A first start whose ports are taken (they are drawn at random by the launcher) serves
    nothing and says so in ``addresses()``: the launcher then draws other ports; one that
    fails otherwise keeps the error for ``addresses()`` to raise in the launcher. A
    restart (``was_current_actor_reconstructed``) must get its ports back: it waits for
    them, then fails, which ends the actor, as any error of a restarted server does.
    """

    def __init__(self, spec_json: bytes) -> None:
        import ray

        spec = msgspec.json.decode(spec_json, type=ServerSpec)
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        if self.restarted:
            spec = as_restarted(spec)  # the controller keeps the live clients' leases
        self.key = spec.key
        self.busy: str | None = None
        self.failed: Exception | None = None
        self.bound: list[str] = []
        wanted = _addresses(spec)
        deadline = time.monotonic() + (BIND_WAIT_S if self.restarted else 0.0)
        while (taken := next((a for a in wanted if not is_free(a)), None)) is not None:
            if time.monotonic() >= deadline:
                if not self.restarted:
                    self.busy = taken
                    return
                raise OSError(errno.EADDRINUSE, f"{taken} is still taken {BIND_WAIT_S}s later")
            time.sleep(0.1)
        fields = msgspec.structs.asdict(spec)
        server: ControllerServer | UnitServer
        try:
            if isinstance(spec, ControllerSpec):
                server = ControllerServer(**fields)
                self.bound = [bound_address(server.sock), bound_address(server.pub)]
            else:
                server = UnitServer(**fields)
                self.bound = [bound_address(server.sock), bound_address(server.control)]
        except Exception as exc:
            if self.restarted:
                raise  # ends the actor: Ray does not restart a failed constructor
            if isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRINUSE:
                self.busy = str(exc)  # taken between the check and the bind
            else:
                self.failed = exc  # raised by addresses(), in the launcher, as it is
            return
        threading.Thread(target=server.serve, name="flowrl-server", daemon=True).start()

    def addresses(self) -> list[str] | str:
        """The bound addresses (controller: its address and its events address; storage
        unit: its address and its control address), or why it could not bind (a str).
        Raises what made the server fail to start (a ``ConfigError`` for a journal of
        another shape, ...)."""
        if self.failed is not None:
            raise self.failed
        return self.busy if self.busy is not None else self.bound

    def hub_key(self) -> str | None:
        """The hub key's text (the Ray cluster's processes connect with it)."""
        return self.key

    def pid(self) -> int:
        """This actor's process (a test kills it to simulate a crash)."""
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _addresses(spec: ServerSpec) -> list[str]:
    if isinstance(spec, ControllerSpec):
        return [spec.address, spec.events_address]
    return [spec.address, spec.control_address]
