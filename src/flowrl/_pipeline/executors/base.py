"""The executor interface: run a frozen pipeline against a hub, return a RunResult."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.result import RunResult
    from flowrl._schema.columns import Column

__all__ = ["Executor"]


class Executor(ABC):
    """Runs every stage of a pipeline until the stream ends, a stage fails, or ``stop()``.

    ``run`` registers the pipeline's tasks on the hub, starts the stage workers, ends the
    stream of each stage's outputs once the stage is done, and raises the first stage's
    :class:`~flowrl.errors.StageError` after stopping the other workers (their leases are
    released, so no sample is lost).
    """

    @abstractmethod
    def run(self, pipeline: Pipeline, hub: HubClient) -> RunResult:
        """Run to completion (blocking); raise the first stage failure."""

    @abstractmethod
    def stop(self) -> None:
        """Ask a ``run`` in progress in another thread to stop soon; it then returns."""

    def default_hub(self, columns: Sequence[Column]) -> HubClient:
        """The hub a run makes when given none (closed after the run): an in-process one."""
        from flowrl._client.inproc import Hub

        return Hub(columns)
