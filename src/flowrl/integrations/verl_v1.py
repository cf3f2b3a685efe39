"""verl 0.9.1's V1 trainer (``verl.trainer.ppo.v1``) with its TransferQueue on a flowrl hub.

The V1 trainer keeps prompts and trajectories in TransferQueue and reaches it through
``import transfer_queue as tq`` in the trainer, its agent-loop workers and its replay
buffer. Two pieces put flowrl underneath, verl's code unchanged:

* :func:`use_flowrl_transfer_queue` makes ``transfer_queue`` name
  :mod:`flowrl.compat.transfer_queue` in the calling process. It must run before verl's V1
  modules are imported, in every process of the job: name it as Ray's
  ``runtime_env.worker_process_setup_hook`` (docs/verl.md has the command line).
* ``HubReplayBuffer`` (``trainer.v1.trainer_mode=sync``) and ``HubReplayBufferAsync`` (the
  async modes), for ``trainer.v1.sampler.custom_sampler``: verl's own replay buffers (the
  same group status tracking, staleness eviction and DAPO filtering), except that between
  two looks at the key listing they sleep until a key or tag changes in the hub's key
  directory instead of a fixed ``poll_interval`` (2 s in verl): a batch is handed to the
  trainer as soon as its last group finishes.

The classes are built on first access (``getattr(module, "HubReplayBuffer")``, what verl's
``load_extern_type`` does), so importing this module imports neither verl nor
TransferQueue.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from types import ModuleType
from typing import Any

from flowrl.errors import ConfigError
from flowrl.integrations._verl_compat import check_verl_release, require_verl

# TransferQueue's public submodules that user programs import by their full name
SUBMODULES = ("metadata", "sampler")

__all__ = [
    "HubReplayBuffer",  # noqa: F822 (built on first access, see __getattr__)
    "HubReplayBufferAsync",  # noqa: F822
    "route_transfer_queue",
    "use_flowrl_transfer_queue",
]

#: sampler_kwargs passed on to verl's replay buffer (the rest of its constructor comes from
#: verl's trainer); ``poll_interval`` bounds one wait for a change.
_BUFFER_OPTIONS = (
    "poll_interval",
    "filter_groups_metric",
    "train_batch_size",
    "gen_batch_size",
    "max_inflight_gen_batches",
    "sync_refill_failed_groups",
)


def use_flowrl_transfer_queue() -> None:
    """Make ``import transfer_queue`` give :mod:`flowrl.compat.transfer_queue` here.

    Best called before verl is imported (Ray's ``worker_process_setup_hook`` runs it first
    in every worker process). verl modules imported before have the names they took from
    ``transfer_queue`` (``tq``, ``KVBatchMeta``, ``BatchMeta``) pointed at flowrl's too.
    Calling it again is harmless.
    """
    check_verl_release()
    import flowrl.compat.transfer_queue as compat

    route_transfer_queue(compat)


def route_transfer_queue(target: ModuleType) -> None:
    """Make ``transfer_queue`` name ``target`` in ``sys.modules`` and in the verl modules
    already imported (``use_flowrl_transfer_queue`` with flowrl's; TransferQueue's own
    module to undo it)."""
    current = sys.modules.get("transfer_queue")
    sys.modules["transfer_queue"] = target
    for sub in SUBMODULES:  # `import transfer_queue.metadata` must follow the package
        sys.modules.pop(f"transfer_queue.{sub}", None)
        with contextlib.suppress(ImportError):
            module = importlib.import_module(f"{target.__name__}.{sub}")
            sys.modules[f"transfer_queue.{sub}"] = module
    if current is None or current is target:
        return
    package = current.__name__
    for name, module in list(sys.modules.items()):
        if name != "verl" and not name.startswith("verl."):
            continue
        space = getattr(module, "__dict__", {})
        for attr, value in list(space.items()):
            if value is current:
                space[attr] = target
            elif _defined_in(value, package) and hasattr(target, attr):
                space[attr] = getattr(target, attr)


def _defined_in(value: Any, package: str) -> bool:
    where = getattr(value, "__module__", None)
    return isinstance(where, str) and (where == package or where.startswith(package + "."))


def __getattr__(name: str) -> Any:
    if name in ("HubReplayBuffer", "HubReplayBufferAsync"):
        return _replay_buffers()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _replay_buffers() -> dict[str, type]:
    require_verl()
    import flowrl.compat.transfer_queue as compat

    if sys.modules.get("transfer_queue") is not compat:
        raise ConfigError(
            "HubReplayBuffer reads verl's TransferQueue through flowrl, but transfer_queue is "
            "TransferQueue itself in this process: call "
            "flowrl.integrations.verl_v1.use_flowrl_transfer_queue() first (Ray's "
            "worker_process_setup_hook, see docs/verl.md)"
        )
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    class _WakeOnChange:
        """Waits for a change in the key directory instead of sleeping poll_interval."""

        poll_interval: float
        _seen = -1

        def __init__(self, *args: Any, sampler_kwargs: Any = None, **kwargs: Any) -> None:
            options = dict(sampler_kwargs or {})
            unknown = sorted(set(options) - set(_BUFFER_OPTIONS))
            if unknown:
                raise ConfigError(
                    f"{type(self).__name__}: trainer.v1.sampler.sampler_kwargs {unknown} are not "
                    f"understood; it takes {list(_BUFFER_OPTIONS)}"
                )
            mode = kwargs.get("trainer_mode", args[0] if args else None)
            wanted = "HubReplayBuffer" if mode == "sync" else "HubReplayBufferAsync"
            if type(self).__name__ != wanted:
                raise ConfigError(
                    f"trainer.v1.trainer_mode={mode!r} samples with {wanted}, got "
                    f"{type(self).__name__} in trainer.v1.sampler.custom_sampler.name"
                )
            super().__init__(*args, sampler_kwargs=sampler_kwargs, **{**kwargs, **options})  # type: ignore[call-arg]

        def _sync_metadata_from_transfer_queue(self) -> None:
            self._seen = compat.get_client().directory.generation()
            super()._sync_metadata_from_transfer_queue()  # type: ignore[misc]

        def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
            compat.get_client().directory.wait_changed(self._seen, float(self.poll_interval))
            return last_debug_time

    class HubReplayBuffer(_WakeOnChange, ReplayBuffer):  # type: ignore[misc, valid-type]
        """verl's sync ReplayBuffer, woken by the hub's key directory."""

    class HubReplayBufferAsync(_WakeOnChange, ReplayBufferAsync):  # type: ignore[misc, valid-type]
        """verl's ReplayBufferAsync, woken by the hub's key directory."""

    for cls in (HubReplayBuffer, HubReplayBufferAsync):
        cls.__module__ = __name__
    return {"HubReplayBuffer": HubReplayBuffer, "HubReplayBufferAsync": HubReplayBufferAsync}
