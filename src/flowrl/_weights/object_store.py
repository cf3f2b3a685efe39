"""Weight sync through the Ray object store, for rollout engines on other nodes.

:class:`RayWeightPublisher` puts each version in the object store once (``ray.put`` of
one uint8 array per tensor: Ray writes each array's bytes straight into the store, no
pickled copy) and tells a small registry actor, named after the channel, the version,
its object reference and the tensors' names, dtypes and shapes. A
:class:`RayWeightSubscriber` on any worker or node asks the registry for a newer
version (one actor call, cheap enough between decoding steps) and ``ray.get``-s it: on
the publisher's node the arrays are views of the store's shared memory (no copy), on
another node Ray first transfers the object to that node's store. Objects are immutable,
so a reader never sees a half-written version; a version's memory is freed once the
registry moved on and no snapshot holds it.

The same interface as the shared-memory pair (:class:`~flowrl._weights.sync.
BaseWeightPublisher` / ``BaseWeightSubscriber``): ``publish``, ``publish_async``,
``poll``, ``sync(engine)``, ``close``. Ray is imported when a publisher or subscriber is
made, and it connects to the running cluster (``ray.init()`` if this process is not).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

from flowrl._launch.ray_hub import import_ray
from flowrl._weights.sync import (
    BaseWeightPublisher,
    BaseWeightSubscriber,
    TensorEntry,
    WeightSnapshot,
    _check_name,
    _copy_in,
    typed,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["RayWeightPublisher", "RayWeightSubscriber"]

NAMESPACE = "flowrl"
_REGISTRY_PREFIX = "flowrl-weights-"


class _Registry:
    """The newest version of a channel: ``(version, [object ref], entries)``; the ref is
    wrapped in a list so that Ray passes it along instead of fetching its object."""

    def __init__(self) -> None:
        self._newest: tuple[int, list[Any], tuple[TensorEntry, ...]] | None = None

    def publish(self, version: int, ref: list[Any], entries: tuple[TensorEntry, ...]) -> None:
        self._newest = (version, ref, entries)

    def newer(self, have: int | None) -> tuple[int, list[Any], tuple[TensorEntry, ...]] | None:
        if self._newest is None or (have is not None and self._newest[0] <= have):
            return None
        return self._newest

    def close(self) -> None:
        """Forget the newest version: ``ray.kill`` takes effect later, and a subscriber
        must not get a closed channel's version meanwhile."""
        self._newest = None


@functools.cache
def _registry_actor() -> Any:
    ray = import_ray()
    return ray.remote(num_cpus=0, max_concurrency=1)(_Registry)


@final
class RayWeightPublisher(BaseWeightPublisher):
    """Publishes versions of named tensors through the Ray object store (module
    docstring). ``name``: the channel, unique in the cluster (one per trainer); ``dtype``:
    the transfer dtype of floating-point tensors (``torch.bfloat16`` halves the bytes;
    the cast goes into one staging buffer kept between versions), ``None`` to send them
    as they are."""

    def __init__(self, name: str, *, dtype: torch.dtype | None = None) -> None:
        _check_name(name)
        super().__init__(dtype=dtype)
        self.name = name
        self._ray = import_ray()
        actor = _registry_actor().options(name=_REGISTRY_PREFIX + name, namespace=NAMESPACE)
        try:
            self._registry = actor.remote()
        except ValueError as exc:  # the name is taken
            from flowrl.errors import ConfigError

            raise ConfigError(
                f"RayWeightPublisher: channel {name!r} already has a publisher in this Ray "
                "cluster; give each trainer its own channel name"
            ) from exc
        self._newest: list[Any] = []  # the newest version's ref, held as the registry does
        self._staging: torch.Tensor | None = None

    def _write(
        self, tensors: list[torch.Tensor], entries: list[TensorEntry], size: int, version: int
    ) -> None:
        arrays = self._as_bytes(tensors, entries, size)
        ref = [self._ray.put(arrays)]
        del arrays
        self._ray.get(self._registry.publish.remote(version, ref, tuple(entries)))
        self._newest = ref

    def _as_bytes(
        self, tensors: list[torch.Tensor], entries: list[TensorEntry], size: int
    ) -> list[np.ndarray]:
        """One uint8 array per tensor: views of the tensors, or of their cast copy."""
        import torch

        if self.dtype is None:
            return [t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8)
        _copy_in(self._staging, tensors, entries)
        return [self._staging[e.offset : e.offset + e.nbytes].numpy() for e in entries]

    def _close(self) -> None:
        with contextlib.suppress(self._ray.exceptions.RayActorError):  # died already
            self._ray.get(self._registry.close.remote())
        self._ray.kill(self._registry)
        self._newest = []
        self._staging = None


@final
class _RaySnapshot(WeightSnapshot):
    def __init__(
        self, version: int, entries: Sequence[TensorEntry], ref: Any, arrays: list[np.ndarray]
    ) -> None:
        import torch

        super().__init__(version, entries)
        self._ref = ref
        with warnings.catch_warnings():  # the store's memory is read-only by design
            warnings.simplefilter("ignore", UserWarning)
            self._flat = [torch.from_numpy(a) for a in arrays]

    def _tensor(self, index: int, entry: TensorEntry) -> torch.Tensor:
        return typed(self._flat[index], entry)

    def _release(self) -> None:
        self._flat = []
        self._ref = None


@final
class RayWeightSubscriber(BaseWeightSubscriber):
    """Finds the versions a :class:`RayWeightPublisher` of ``name`` publishes, from any
    worker or node of the cluster (module docstring)."""

    def __init__(self, name: str) -> None:
        _check_name(name)
        super().__init__()
        self.name = name
        self._ray = import_ray()
        self._registry: Any = None

    def _poll(self, have: int | None) -> WeightSnapshot | None:
        registry = self._find_registry()
        if registry is None:
            return None
        try:
            newest = self._ray.get(registry.newer.remote(have))
        except self._ray.exceptions.RayActorError:
            self._registry = None  # the publisher closed or died: nothing newer
            return None
        if newest is None:
            return None
        version, (ref,), entries = newest
        return _RaySnapshot(version, entries, ref, self._ray.get(ref))

    def _find_registry(self) -> Any:
        if self._registry is None:
            try:
                self._registry = self._ray.get_actor(
                    _REGISTRY_PREFIX + self.name, namespace=NAMESPACE
                )
            except ValueError:
                return None  # no publisher yet
        return self._registry

    def _close(self) -> None:
        self._registry = None
