"""The hub on a Ray cluster: the controller and the storage units as Ray actors.

Each actor runs the same zmq server as a ``launch_hub`` process, in a thread, bound to a
free TCP port on its node's IP address. Clients talk to the servers directly over zmq:
metadata to the controller, bytes to and from the storage units; no payload goes through
the driver or Ray's object store. ``units_per_node`` storage units run on every node, and
a client created with the hub's ``unit_nodes`` and its own node id puts new samples on a
unit of its own node (data locality); a claim's ``BatchMeta.units`` says where each
sample's bytes live.

The actors are owned by the process that launched the hub: closing its client stops
them, and Ray reaps them if that process exits first. They reserve no CPU (``num_cpus=0``):
they wait on sockets and would otherwise take slots from the stage workers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from flowrl._client.config import HubConfig
from flowrl._schema.columns import Column
from flowrl._transport.launch import checked_args, request_shutdown
from flowrl._transport.remote import RPC_TIMEOUT_S, RemoteHub
from flowrl._transport.specs import ControllerSpec, ServerSpec, UnitSpec
from flowrl.errors import ConfigError, TransportError

__all__ = ["import_ray", "launch_ray_hub"]


def launch_ray_hub(
    columns: Iterable[Column] = (),
    *,
    tasks: dict[str, Sequence[str]] | None = None,
    config: HubConfig | None = None,
    units_per_node: int = 1,
    nodes: Sequence[str] | None = None,
    startup_timeout: float = 60.0,
) -> RemoteHub:
    """Start a hub on the Ray cluster this process is connected to (``ray.init()`` first;
    it is called for you if not).

    The controller runs on this process's node; ``units_per_node`` storage units run on
    each of ``nodes`` (Ray node ids; default: every alive node), so the hub has
    ``units_per_node * len(nodes)`` units: leave ``HubConfig.n_units`` at its default or
    set it to that number. Returns a client of this node (its ``unit_nodes`` and ``node``
    set, see :class:`RemoteHub`); other processes ``flowrl.connect(hub.address,
    unit_nodes=hub.unit_nodes, node=<their Ray node id>)``. Closing the returned client
    stops every actor of the hub.
    """
    cols, config = checked_args(columns, config)
    if (
        not isinstance(units_per_node, int)
        or isinstance(units_per_node, bool)
        or units_per_node < 1
    ):
        raise ConfigError(f"units_per_node must be a positive int, got {units_per_node!r}")
    ray = import_ray()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    placed = _check_nodes(nodes, ips)
    unit_nodes = [node for node in placed for _ in range(units_per_node)]
    if config.n_units not in (1, len(unit_nodes)):
        raise ConfigError(
            f"HubConfig.n_units={config.n_units}, but launch_ray_hub places "
            f"units_per_node={units_per_node} storage units on each of {len(placed)} nodes "
            f"({len(unit_nodes)} units); leave n_units at its default or pass units_per_node"
        )
    config = msgspec.structs.replace(config, n_units=len(unit_nodes))
    here = ray.get_runtime_context().get_node_id()
    # Every actor's process starts at once; the controller is told its units' addresses.
    actors = [_host(node) for node in [*unit_nodes, here]]
    try:
        units = [
            UnitSpec(u, config.capacity, _any_port(ips[n]), _any_port(ips[n]), config.journal)
            for u, n in enumerate(unit_nodes)
        ]
        unit_bound = ray.get(
            [a.start.remote(_spec(s)) for a, s in zip(actors[:-1], units, strict=True)],
            timeout=startup_timeout,
        )
        controller = ControllerSpec(
            _any_port(ips[here]),
            _any_port(ips[here]),
            [b[0] for b in unit_bound],
            [b[1] for b in unit_bound],
            cols,
            {t: list(c) for t, c in (tasks or {}).items()},
            config,
        )
        address = ray.get(actors[-1].start.remote(_spec(controller)), timeout=startup_timeout)[0]
        client = RemoteHub(address, rpc_timeout=startup_timeout, unit_nodes=unit_nodes, node=here)
    except Exception as exc:
        _stop(actors, [])
        if isinstance(exc, ConfigError | TransportError):
            raise
        raise TransportError(f"the hub's Ray actors failed to start: {exc!r}") from exc
    client.rpc_timeout = RPC_TIMEOUT_S
    client._on_close.append(lambda: _stop(actors, [address, *(b[0] for b in unit_bound)]))
    return client


def import_ray() -> Any:
    """The ray module, connected to a cluster (``ray.init()`` if this process is not yet)."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "the Ray placement needs ray: pip install 'flowrl[ray]' (or pip install ray)"
        ) from exc
    if not ray.is_initialized():
        ray.init()
    return ray


def _check_nodes(nodes: Sequence[str] | None, ips: dict[str, str]) -> list[str]:
    if nodes is None:
        return sorted(ips)
    if isinstance(nodes, str) or not isinstance(nodes, Sequence) or not nodes:
        raise ConfigError(f"nodes must be a non-empty list of Ray node ids, got {nodes!r}")
    unknown = [n for n in nodes if n not in ips]
    if unknown:
        raise ConfigError(
            f"nodes {unknown} are not alive nodes of this Ray cluster; pass ids from "
            "ray.nodes() (their 'NodeID'), or leave nodes=None for every node"
        )
    return list(dict.fromkeys(nodes))


def _any_port(ip: str) -> str:
    return f"tcp://{ip}:*"  # zmq binds a free port; the server reports which


def _spec(spec: ServerSpec) -> bytes:
    return msgspec.json.encode(spec)


def _host(node: str) -> Any:
    """A server host actor pinned to ``node``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    return _server_actor().options(scheduling_strategy=strategy).remote()


def _stop(actors: list[Any], addresses: list[str]) -> None:
    """Let the servers leave their loops (so they answer waiting clients and close their
    files), then end the actors. After ``ray.shutdown()`` they are gone already."""
    import ray

    if not ray.is_initialized():
        return
    request_shutdown(addresses)
    for actor in actors:
        ray.kill(actor)


@functools.cache
def _server_actor() -> Any:
    import ray

    from flowrl._transport.ray_server import ServerHost

    return ray.remote(num_cpus=0)(ServerHost)
