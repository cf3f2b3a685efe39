"""WeightStore: the trainer publishes weights, rollout workers pick them up between batches.

In-process, weights live in one set of shared tensors: ``publish`` copies the trainer's
parameters into them under a lock and returns the new version, which the trainer then
announces with ``hub.publish_version`` (a ``VersionPublished`` event); ``pull`` copies
them into a worker's model only when the version moved. The copy is the whole cost of a
weight sync — no serialisation.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, final

from flowrl.errors import ConfigError

if TYPE_CHECKING:  # torch is imported lazily: hub servers import flowrl without it
    import torch

__all__ = ["WeightStore"]


@final
class WeightStore:
    """Versioned weights shared by a trainer and the workers that sample with them."""

    def __init__(self, model: torch.nn.Module, *, version: int = 0) -> None:
        self._lock = threading.Lock()
        self._tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def publish(self, model: torch.nn.Module, version: int | None = None) -> int:
        """Copy ``model``'s weights in as the next (or the given) version; returns it."""
        state = model.state_dict()
        if state.keys() != self._tensors.keys():
            raise ConfigError(
                "WeightStore.publish: the model's parameters differ from the ones the store "
                "was built with; publish the same architecture"
            )
        import torch

        with self._lock, torch.no_grad():
            for name, tensor in state.items():
                self._tensors[name].copy_(tensor)
            self._version = self._version + 1 if version is None else version
            return self._version

    def pull(self, model: torch.nn.Module, have: int) -> int:
        """Load the latest weights into ``model`` if newer than version ``have``."""
        if self._version == have:
            return have
        with self._lock:
            model.load_state_dict(self._tensors)
            return self._version
