"""A real hub whose user is preempted after a number of appends, for the partial-rollout
tests of the built-in sampler (test_partial_rollout.py) and of the engines
(test_engines_durable.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

import flowrl


class Preempted(Exception):
    """Stands for the worker being preempted right after an append."""


class PreemptedAfter:
    """A real hub whose user is preempted after ``n`` appends (it records what they were)."""

    def __init__(self, hub: flowrl.Hub, n: int) -> None:
        self.hub = hub
        self.n = n
        self.appended: dict[str, list[list[Any]]] = {}

    def partial(self, *args: Any, **kwargs: Any) -> Any:
        return self.hub.partial(*args, **kwargs)

    def append_async(
        self, meta: Any, column: Any, values: Any = None, *, version: int
    ) -> flowrl.PutFuture:
        """The generators' append: made here synchronously, so the preemption comes after
        it landed."""
        self.hub.append(meta, column, values, version=version)
        data = column if isinstance(column, dict) else {column: values}
        for name, vals in data.items():
            rows = self.appended.setdefault(name, [[] for _ in range(len(meta))])
            for i, v in enumerate(vals):
                rows[i].extend(np.asarray(v).tolist())
        self.n -= 1
        if self.n == 0:
            raise Preempted
        return flowrl.PutFuture.completed(meta.indices)
