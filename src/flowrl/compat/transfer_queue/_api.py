"""TransferQueue's module-level API: ``init``, ``close``, ``get_client`` and the KV functions.

``init`` starts (or joins) one hub per process tree, in the placement the config names:

* ``inproc`` (default): the embedded hub and an in-process key directory; no servers.
* ``zmq``: ``flowrl.launch_hub`` processes and a key directory served by this process; the
  addresses go to ``FLOWRL_TQ_ADDRESS`` in the environment, so processes started after
  ``init`` join the same hub when they call ``init()``.
* ``ray``: ``flowrl.launch_ray_hub`` actors and the directory on a TCP port of this node;
  the addresses are kept by a named Ray actor that ``init()`` in any Ray worker finds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import msgspec

from flowrl._client.base import HubClient
from flowrl._client.inproc import Hub
from flowrl._config import HubConfig
from flowrl.compat.transfer_queue._client import DEFAULT_PUT_TIMEOUT, TransferQueueClient
from flowrl.compat.transfer_queue._directory import DirectoryServer, KeyDirectory, RemoteDirectory
from flowrl.compat.transfer_queue._meta import KVBatchMeta
from flowrl.compat.transfer_queue._sampling import SamplerRunner, resolve_sampler
from flowrl.errors import ConfigError

__all__ = [
    "ADDRESS_ENV",
    "async_kv_batch_get",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "init",
    "kv_batch_get",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
]

#: Where ``init`` in the zmq placement leaves the hub's and the directory's addresses.
ADDRESS_ENV = "FLOWRL_TQ_ADDRESS"
_RAY_ACTOR = "flowrl_tq_addresses"
_RAY_NAMESPACE = "flowrl_transfer_queue"
_PLACEMENTS = ("inproc", "zmq", "ray")


class _State:
    """What ``init`` made in this process and ``close`` undoes."""

    client: TransferQueueClient | None = None
    owned: list[Callable[[], object]] = []
    config: dict[str, Any] = {}
    pid = 0  # the process that made them: a forked child (a DataLoader worker) starts afresh


def _forked() -> bool:
    """Whether the state was inherited through fork (its sockets are the parent's)."""
    return _State.client is not None and _State.pid != os.getpid()


def init(conf: Any = None, *, hub: HubClient | None = None) -> dict[str, Any]:
    """Start the hub (first call in a process tree) or join it; returns the config used.

    ``conf`` (a dict or an OmegaConf config) keeps TransferQueue's keys where they mean
    something here: ``controller.polling_mode``, ``controller.sampler`` (a sampler name,
    class or instance; it runs in this process for the whole hub),
    ``backend.SimpleStorage.num_data_storage_units`` (storage units) and
    ``total_storage_size`` (capacity). flowrl's own under ``flowrl``:
    ``placement`` (``inproc`` | ``zmq`` | ``ray``), ``fetch_timeout`` (seconds get_meta
    waits), ``put_timeout`` (seconds a put waits for room in a full hub), ``lease_timeout``.
    ``hub``: serve an existing flowrl hub instead.
    """
    if _forked():  # leave the parent's client and servers alone; join them instead
        _State.client, _State.owned = None, []
    if _State.client is not None:
        return _State.config
    config = _parse(conf)
    options = config["flowrl"]
    client_args = {
        "polling_mode": config["controller"]["polling_mode"],
        "fetch_timeout": options["fetch_timeout"],
        "put_timeout": options["put_timeout"],
    }
    joined = _join(options["placement"]) if hub is None else None
    if joined is None and hub is None and options["placement"] == "inproc":
        _refuse_a_private_hub_in_a_ray_worker(conf)
    if joined is not None:
        joined_hub, remote = joined
        _State.owned.append(joined_hub.close)  # this process's connection, not the hub
        sampling = remote if remote.sampler_name() else None  # the hub's, not conf's
        _State.client = TransferQueueClient(joined_hub, remote, sampling=sampling, **client_args)
    else:
        hub, directory, runner = _start(options["placement"], config, hub)
        _State.client = TransferQueueClient(hub, directory, sampling=runner, **client_args)
    _State.config = config
    _State.pid = os.getpid()
    return config


def close() -> None:
    """Close this process's client, and the hub if this process started it."""
    client, _State.client = _State.client, None
    owned, _State.owned = _State.owned, []
    if client is not None:
        client.close()
    for undo in reversed(owned):
        undo()
    _State.config = {}


def get_client() -> TransferQueueClient:
    """This process's client (``init`` first)."""
    if _State.client is None or _forked():
        raise ConfigError(
            "TransferQueue (flowrl compat) is not initialised in this process; call tq.init() first"
        )
    return _State.client


# -- KV API ----------------------------------------------------------------------------------
def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> KVBatchMeta:
    """Put one key's fields (TensorDict of batch 1, or a dict of its values) and/or tag; a
    new key waits up to ``timeout`` s (default ``flowrl.put_timeout``) for room."""
    return get_client().kv_put(key, partition_id, fields, tag, timeout=timeout)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    *,
    timeout: float | None = None,
) -> KVBatchMeta:
    """Put the fields (a TensorDict, batch = len(keys)) and/or tags of several keys; new
    keys wait up to ``timeout`` s (default ``flowrl.put_timeout``) for room."""
    return get_client().kv_batch_put(keys, partition_id, fields, tags, timeout=timeout)


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """The keys' fields as a TensorDict (default: the fields all of them have)."""
    return get_client().kv_batch_get(keys, partition_id, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """``{partition: {key: tag}}`` for one partition or all."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys and evict their samples."""
    get_client().kv_clear(keys, partition_id)


_T = TypeVar("_T")


def _in_thread(fn: Callable[..., _T]) -> Callable[..., Any]:
    """The ``async_`` twin of a blocking function: it runs in a worker thread."""

    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> _T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    run.__name__ = run.__qualname__ = f"async_{fn.__name__}"
    return run


async_kv_put = _in_thread(kv_put)
async_kv_batch_put = _in_thread(kv_batch_put)
async_kv_batch_get = _in_thread(kv_batch_get)
async_kv_list = _in_thread(kv_list)
async_kv_clear = _in_thread(kv_clear)


# -- start, join -------------------------------------------------------------------------------
def _start(
    placement: str, config: dict[str, Any], hub: HubClient | None
) -> tuple[HubClient, KeyDirectory, SamplerRunner | None]:
    directory = KeyDirectory()
    if hub is None:
        hub_config = HubConfig(
            capacity=config["backend"]["SimpleStorage"]["total_storage_size"],
            n_units=config["backend"]["SimpleStorage"]["num_data_storage_units"],
            lease_timeout=config["flowrl"]["lease_timeout"],
        )
        hub = _launch(placement, hub_config)
        _State.owned.append(hub.close)
    sampler = config["controller"]["sampler"]
    runner = None if sampler is None else SamplerRunner(hub, sampler)
    if isinstance(hub, Hub):
        return hub, directory, runner
    if placement == "ray":
        server = DirectoryServer(directory, f"tcp://{_node_ip()}:0", runner, hub.key)  # type: ignore[attr-defined]
    else:
        folder = tempfile.mkdtemp(prefix="flowrl-tq-")
        server = DirectoryServer(directory, f"ipc://{folder}/directory", runner)
        _State.owned.append(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    _State.owned.append(server.close)
    addresses = {"hub": hub.address, "directory": server.address}  # type: ignore[attr-defined]
    if placement == "ray":
        _publish_on_ray(addresses)
    else:
        os.environ[ADDRESS_ENV] = json.dumps(addresses)
        _State.owned.append(lambda: os.environ.pop(ADDRESS_ENV, None))
    return hub, directory, runner


def _launch(placement: str, config: HubConfig) -> HubClient:
    from flowrl._launch.processes import launch_hub
    from flowrl._launch.ray_hub import launch_ray_hub

    if placement == "inproc":
        return Hub(config=config)
    if placement == "zmq":
        return launch_hub(config=config)
    # TransferQueue's unit count, per node: launch_ray_hub places that many on every node
    units = config.n_units
    return launch_ray_hub(config=msgspec.structs.replace(config, n_units=1), units_per_node=units)


def _join(placement: str) -> tuple[HubClient, RemoteDirectory] | None:
    """A client of the hub an earlier ``init`` started in this process tree, if any."""
    from flowrl._launch.processes import connect

    raw = os.environ.get(ADDRESS_ENV)
    addresses = json.loads(raw) if raw else None
    if addresses is None and (placement == "ray" or "ray" in sys.modules):  # a Ray worker?
        addresses = _find_on_ray()
    if addresses is None:
        return None
    hub = connect(addresses["hub"])  # (a hub on Ray: its key, from its controller actor)
    return hub, RemoteDirectory(addresses["directory"], hub.key)


def _refuse_a_private_hub_in_a_ray_worker(conf: Any) -> None:
    """A bare ``init()`` in a Ray worker that found no hub to join fails here: an embedded
    hub of its own would take the worker's puts where no other process sees them. (An
    ``inproc`` placement the caller names is theirs to have.)"""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return  # the driver
    flowrl_options = (conf or {}).get("flowrl") if hasattr(conf, "get") else None
    if flowrl_options and flowrl_options.get("placement") is not None:
        return
    raise ConfigError(
        "tq.init() in a Ray worker found no TransferQueue hub to join, and would start a "
        "private one that no other process sees. Start the driver's hub with "
        "tq.init({'flowrl': {'placement': 'ray'}}) before the workers (they join it with a "
        f"bare tq.init()), or with placement 'zmq' and pass its {ADDRESS_ENV} to the workers "
        f"(runtime_env={{'env_vars': {{'{ADDRESS_ENV}': ...}}}}); to want a hub of this "
        "worker's own, say tq.init({'flowrl': {'placement': 'inproc'}})"
    )


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _publish_on_ray(addresses: dict[str, str]) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Addresses:
        def __init__(self, value: str) -> None:
            self.value = value

        def get(self) -> str:
            return self.value

    actor = Addresses.options(name=_RAY_ACTOR, namespace=_RAY_NAMESPACE).remote(  # type: ignore[attr-defined]
        json.dumps(addresses)
    )
    ray.get(actor.get.remote())
    _State.owned.append(lambda: ray.kill(actor))


def _find_on_ray() -> dict[str, str] | None:
    import ray

    if not ray.is_initialized():
        return None
    try:
        actor = ray.get_actor(_RAY_ACTOR, namespace=_RAY_NAMESPACE)
    except ValueError:
        return None
    return json.loads(cast(str, ray.get(actor.get.remote())))


# -- config ------------------------------------------------------------------------------------
def _parse(conf: Any) -> dict[str, Any]:
    """TransferQueue's config (or None) as a plain dict with every key this client reads."""
    if conf is None:
        raw: dict[str, Any] = {}
    elif hasattr(conf, "_metadata") and hasattr(conf, "items"):  # an OmegaConf config
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(conf, resolve=True)  # type: ignore[assignment]
    elif isinstance(conf, Mapping):
        raw = dict(conf)
    else:
        raise ConfigError(f"tq.init() conf must be a dict or an OmegaConf config, got {conf!r}")
    controller = dict(raw.get("controller") or {})
    simple = dict((raw.get("backend") or {}).get("SimpleStorage") or {})
    backend = (raw.get("backend") or {}).get("storage_backend", "SimpleStorage")
    if backend != "SimpleStorage":
        raise ConfigError(
            f"tq.init(): backend.storage_backend {backend!r} is not supported; flowrl's "
            "storage units take the place of SimpleStorage"
        )
    options = dict(raw.get("flowrl") or {})
    placement = options.get("placement", "inproc")
    if placement not in _PLACEMENTS:
        raise ConfigError(
            f"tq.init(): flowrl.placement must be one of {_PLACEMENTS}, got {placement!r}"
        )
    default_timeout = float(os.environ.get("TQ_CONTROLLER_GET_METADATA_TIMEOUT", 1))
    timeout = options.get("fetch_timeout", default_timeout)
    return {
        "controller": {
            "polling_mode": bool(controller.get("polling_mode", False)),
            "sampler": resolve_sampler(controller.get("sampler")),
        },
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {
                "num_data_storage_units": _positive(simple, "num_data_storage_units", 1),
                "total_storage_size": _positive(simple, "total_storage_size", 100_000),
            },
        },
        "flowrl": {
            "placement": placement,
            "fetch_timeout": _seconds(timeout, "flowrl.fetch_timeout"),
            "put_timeout": _seconds(
                options.get("put_timeout", DEFAULT_PUT_TIMEOUT), "flowrl.put_timeout"
            ),
            "lease_timeout": _seconds(options.get("lease_timeout", 300.0), "flowrl.lease_timeout"),
        },
    }


def _positive(section: Mapping[str, Any], key: str, default: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"tq.init(): backend.SimpleStorage.{key} must be a positive int, got {value!r}"
        )
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(
            f"tq.init(): {what} must be a finite number of seconds >= 0, got {value!r}"
        )
    return float(value)
