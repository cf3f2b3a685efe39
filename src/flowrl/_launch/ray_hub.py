"""The hub on a Ray cluster: the controller and the storage units as Ray actors.

Each actor runs the same zmq server as a ``launch_hub`` process, in a thread, bound to a
TCP port of its node's IP address drawn at launch (``PORTS``). Clients talk to the servers
directly over zmq: metadata to the controller, bytes to and from the storage units; no
payload goes through the driver or Ray's object store. ``units_per_node`` storage units
run on every node, and a client created with the hub's ``unit_nodes`` and its own node
id puts new samples on a unit of its own node (data locality); a claim's
``BatchMeta.units`` says where each sample's bytes live.

Crashes. An actor's constructor takes its server's spec and serves. With a journal, the
actors have ``max_restarts=-1``: when an actor's process dies (a crash, SIGKILL, the OOM
killer, ``ray.kill(actor, no_restart=False)``), Ray re-runs the constructor with the same
spec on the same node (hard node affinity: the journal and the units' Arrow files are on
that node's disk). The new process binds the same addresses, so clients reconnect by
themselves; it learns that it is a restart from
``ray.get_runtime_context().was_current_actor_reconstructed``, and a restarted controller
recovers from the journal keeping the leases of the clients, which survived. Without a
journal a restart would come back empty, so there is none: the actor stays dead and
clients get ``TransportError``. ``hub.servers`` (``RayServers``) counts the restarts.

The actors are owned by the process that launched the hub: closing its client stops
them for good (``ray.kill`` without restart), and Ray reaps them if that process exits
first. They reserve no CPU (``num_cpus=0``): they wait on sockets and would otherwise take
slots from the stage workers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, final

import msgspec

from flowrl._client.tasks import checked_tasks
from flowrl._config import HubConfig
from flowrl._launch.ports import PORTS, Ports
from flowrl._launch.processes import checked_args, request_shutdown
from flowrl._launch.specs import ControllerSpec, ServerSpec, UnitSpec
from flowrl._schema.columns import Column
from flowrl._transport.auth import HubKey
from flowrl._transport.remote import RPC_TIMEOUT_S, RemoteHub
from flowrl.errors import ConfigError, TransportError

__all__ = ["PORTS", "PORT_TRIES", "RayServers", "import_ray", "key_on_ray", "launch_ray_hub"]

#: The Ray namespace of the hub's named actors.
RAY_NAMESPACE = "flowrl"
#: Launch attempts with fresh ports when a drawn port turns out to be taken.
PORT_TRIES = 5


def launch_ray_hub(
    columns: Iterable[Column] = (),
    *,
    tasks: Mapping[str, Sequence[str]] | None = None,
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
    tasks_ = {t: list(c) for t, c in checked_tasks(tasks, cols, config).items()}
    nodes_ = [*unit_nodes, here]
    # Ray restarts a dead server actor only where that brings its state back: from the
    # journal (controller) and the Arrow files (storage units) on its node's disk.
    max_restarts = -1 if config.journal is not None else 0
    key = HubKey.generate()  # (travels to the actors through Ray, which authenticates them)
    actors: list[Any] = []
    try:
        for _ in range(PORT_TRIES):
            ports = Ports(ips)
            units = [
                UnitSpec(
                    u,
                    config.capacity,
                    ports.draw(n),
                    ports.draw(n),
                    config.journal,
                    key=key.export(),
                )
                for u, n in enumerate(unit_nodes)
            ]
            controller = ControllerSpec(
                ports.draw(here),
                ports.draw(here),
                [s.address for s in units],
                [s.control_address for s in units],
                cols,
                tasks_,
                config,
                key=key.export(),
            )
            # Every actor's process starts at once: the addresses are known up front.
            specs: list[ServerSpec] = [*units, controller]
            actors = [_host(n, s, max_restarts) for n, s in zip(nodes_, specs, strict=True)]
            bound = ray.get([a.addresses.remote() for a in actors], timeout=startup_timeout)
            if not any(isinstance(b, str) for b in bound):
                break
            _stop(actors)  # a drawn port was taken on its node: draw again
        else:
            raise TransportError(
                f"the hub's servers found their ports taken {PORT_TRIES} times in a row: "
                f"last {[b for b in bound if isinstance(b, str)]}"
            )
        address = controller.address
        client = RemoteHub(
            address, rpc_timeout=startup_timeout, unit_nodes=unit_nodes, node=here, key=key
        )
    except Exception as exc:
        _stop(actors)
        if isinstance(exc, ConfigError | TransportError):
            raise
        raise TransportError(f"the hub's Ray actors failed to start: {exc!r}") from exc
    client.rpc_timeout = RPC_TIMEOUT_S
    client.servers = RayServers(actors, nodes_)
    client._on_close.append(
        functools.partial(_stop, actors, [address], [s.address for s in units], key)
    )
    return client


def key_on_ray(address: str) -> HubKey | None:
    """The key of the Ray-placed hub whose controller is at ``address``, from its actor
    (None if this process is not connected to that hub's Ray cluster)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        actor = ray.get_actor(_controller_name(address), namespace=RAY_NAMESPACE)
    except ValueError:
        return None
    return HubKey.parse(ray.get(actor.hub_key.remote(), timeout=RPC_TIMEOUT_S))


def _controller_name(address: str) -> str:
    return f"flowrl-hub-controller {address}"


@final
class RayServers:
    """The server actors of a Ray-placed hub (``hub.servers``): one per storage unit, in
    unit order, then the controller; ``nodes`` says where each runs.

    With a journal, Ray restarts an actor whose process died (``max_restarts``), on the
    same node and with the same spec: it binds the same addresses and recovers (see the
    module docstring). Without one the actor stays dead and clients get
    ``TransportError``.
    """

    def __init__(self, actors: list[Any], nodes: list[str]) -> None:
        self.actors = tuple(actors)
        self.nodes = tuple(nodes)

    def pids(self) -> list[int]:
        """Each actor's process id (waits for an actor Ray is restarting)."""
        import ray

        return list(ray.get([a.pid.remote() for a in self.actors], timeout=RPC_TIMEOUT_S))

    def states(self) -> list[str]:
        """Each actor's state in Ray: ``ALIVE``, ``RESTARTING``, ``DEAD``, ..."""
        return [row["State"] for row in self._table()]

    @property
    def restarts(self) -> int:
        """How many times Ray restarted one of the hub's actors, all actors together."""
        return sum(int(row["NumRestarts"]) for row in self._table())

    def _table(self) -> list[dict[str, Any]]:
        # The GCS actor table: ray.util.state would need the dashboard, which is optional.
        from ray._private.state import state

        return [state.actor_table(a._actor_id.hex()) for a in self.actors]


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


def _host(node: str, spec: ServerSpec, max_restarts: int) -> Any:
    """A server host actor serving ``spec``, pinned to ``node`` (hard affinity: restarts
    too, since its journal and files are on that node's disk). The controller's is named
    after its address: the cluster's processes ask it for the hub key (``key_on_ray``)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
        "max_restarts": max_restarts,
    }
    if isinstance(spec, ControllerSpec):
        options.update(name=_controller_name(spec.address), namespace=RAY_NAMESPACE)
    return _server_actor().options(**options).remote(msgspec.json.encode(spec))


def _stop(
    actors: list[Any],
    controller: Sequence[str] = (),
    units: Sequence[str] = (),
    key: HubKey | None = None,
) -> None:
    """Let the servers leave their loops (so they answer waiting clients and close their
    files), then end the actors. After ``ray.shutdown()`` they are gone already."""
    import ray

    if not ray.is_initialized():
        return
    request_shutdown(controller, key, units=units)
    for actor in actors:
        ray.kill(actor)  # no_restart: an actor ended on purpose stays dead


@functools.cache
def _server_actor() -> Any:
    import ray

    from flowrl._launch.ray_server import ServerHost

    return ray.remote(num_cpus=0)(ServerHost)
