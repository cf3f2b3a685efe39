"""The hub client over zmq: same API as the embedded hub, servers in other processes.

``RemoteHub`` opens a session with the hub's servers and plugs the zmq ports into the
client: commands go to the controller (``remote_control``), bytes straight to the storage
units (``remote_data``). The jobs around them live beside them: the sockets and replies
(``session``), indices reserved ahead (``pools``), put_async requests in flight
(``inflight``) and the event stream (``subscriber``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, final

from flowrl._client.base import HubClient
from flowrl._config import HubConfig
from flowrl._schema.schema import Schema
from flowrl._transport import wire
from flowrl._transport.auth import HubKey
from flowrl._transport.remote_control import RemoteControl
from flowrl._transport.remote_data import RemoteData
from flowrl._transport.session import RPC_TIMEOUT_S, Session
from flowrl._validate import check_seconds, int_in
from flowrl.errors import ConfigError, FlowRLError

__all__ = ["RPC_TIMEOUT_S", "RemoteHub"]

log = logging.getLogger("flowrl.client")


@final
class RemoteHub(HubClient):
    """A client of a multi-process hub. Get one from ``flowrl.launch_hub``,
    ``flowrl.launch_ray_hub`` or ``flowrl.connect``.

    ``unit_nodes``: the node each storage unit runs on (Ray node ids for a Ray-placed hub)
    and ``node``: the node of this client. New samples then go to a storage unit on the
    client's own node when it has one (data locality); without them, the controller picks.
    ``key``: the hub's key, which a hub on TCP requires (``key`` holds it for others).
    """

    _data: RemoteData

    def __init__(
        self,
        address: str,
        *,
        rpc_timeout: float = RPC_TIMEOUT_S,
        unit_nodes: Sequence[str] = (),
        node: str = "",
        key: HubKey | None = None,
    ) -> None:
        if isinstance(unit_nodes, str) or not all(isinstance(n, str) for n in unit_nodes):
            raise ConfigError(f"unit_nodes must be a list of node ids, got {unit_nodes!r}")
        if not isinstance(node, str):
            raise ConfigError(f"node must be a node id (str), got {node!r}")
        self.address = address
        self.key = key
        self._session = Session(address, _rpc_timeout(rpc_timeout), key)
        self.servers: Any = None  # launch_hub's server processes (None after connect())
        self._on_close: list[Callable[[], None]] = []  # (launch_hub's: stop the servers)
        welcome = self._session.call(None, wire.Hello())[0]
        self.config: HubConfig = welcome.config
        infer = (
            self.config.infer_columns
            if self.config.infer_columns is not None
            else not welcome.columns
        )
        self.schema = Schema(welcome.columns, infer=infer)
        self.unit_addresses: list[str] = list(welcome.units)
        self._session.unit_addresses = self.unit_addresses
        self.events_address: str = welcome.events
        # Every storage unit answers before the client is handed out: a unit process may
        # still be starting (launch_hub waits for the controller only), and a first write
        # that waits for it could outlive its reservation (reservations expire).
        for unit in range(len(self.unit_addresses)):
            self._session.call(unit, wire.UnitStatsReq())
        self.unit_nodes: tuple[str, ...] = tuple(unit_nodes)
        self.node = node
        local = [u for u, n in enumerate(self.unit_nodes) if n == node]
        self._control = RemoteControl(
            self._session, self.schema, self.config, self.events_address, local or None
        )
        self._data = RemoteData(self._session, self.schema, self._control)
        if self.unit_nodes and len(self.unit_nodes) != len(self.unit_addresses):
            self.close()
            raise ConfigError(
                f"unit_nodes names {len(self.unit_nodes)} nodes, but the hub at {address} has "
                f"{len(self.unit_addresses)} storage units; pass one node id per unit"
            )

    @property
    def rpc_timeout(self) -> float:
        """How long a server may stay silent before it is presumed gone (seconds)."""
        return self._session.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, seconds: float) -> None:
        self._session.rpc_timeout = _rpc_timeout(seconds)

    @property
    def max_puts_in_flight(self) -> int:
        """put_async requests a thread may have unanswered; the next waits for the oldest."""
        return self._data.puts.limit

    @max_puts_in_flight.setter
    def max_puts_in_flight(self, n: int) -> None:
        self._data.puts.limit = int_in(n, 1, "max_puts_in_flight must be a positive int")

    def close(self) -> None:
        if self._closed:
            return
        self._send_held_puts()
        if self._data.puts.any_pending():  # this thread's unanswered put_async
            try:
                self.flush(timeout=self.rpc_timeout)
            except FlowRLError as exc:
                log.warning("a put_async failed before close(): %s", exc)
        super().close()  # (gives back the indices reserved ahead, stops the event relay)
        self._session.close()  # (before stopping the servers: that needs sockets too)
        for fn in self._on_close:
            fn()


def _rpc_timeout(seconds: Any) -> float:
    timeout = check_seconds(seconds, "rpc_timeout", allow_zero=False)
    if timeout is None:
        raise ConfigError("rpc_timeout must be a number of seconds > 0, got None")
    return timeout
