"""A trainer that stops getting batches fails with a diagnosis instead of waiting forever.

:func:`next_batch` takes the trainer's next batch from a :class:`~flowrl.Loader`; when none
comes within the stall timeout it raises
:class:`~flowrl.errors.Timeout` with what the hub holds for each task (ready, leased,
consumed), which stages have work in hand and for how long, the policy version and how
full the hub is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flowrl._client.base import HubClient
from flowrl._client.batch import Batch
from flowrl._observers.timeline import Timeline
from flowrl._pipeline.loader import Loader
from flowrl.errors import Timeout

__all__ = ["HEALTH_CHECK_S", "diagnose", "next_batch"]

HEALTH_CHECK_S = 1.0  # how often a waiting trainer checks the run's other processes


def next_batch(
    loader: Loader,
    hub: HubClient,
    timeline: Timeline,
    *,
    step: int,
    stall_timeout: float,
    health: Callable[[], None] | None = None,
) -> Batch:
    """``next(loader)``, waiting up to ``stall_timeout`` s; then a :class:`Timeout` with
    :func:`diagnose`. ``loader`` times out every :data:`HEALTH_CHECK_S` s at most, and
    ``health`` (which raises what stopped a part of the run that runs elsewhere, e.g. the
    rollout process) is called each time."""
    deadline = time.monotonic() + stall_timeout
    while True:
        try:
            return next(loader)
        except Timeout as exc:
            if health is not None:
                health()
            if time.monotonic() < deadline:
                continue
            raise Timeout(
                f"the trainer waited {stall_timeout:g}s (--stall-timeout) for the "
                f"{loader.batch_size} samples of step {step + 1} and none came: the run "
                f"stopped making progress. {diagnose(hub, timeline)}. Raise --stall-timeout "
                "if one step legitimately takes longer."
            ) from exc


def diagnose(hub: HubClient, timeline: Timeline) -> str:
    """What each task of ``hub`` holds and is doing, in one paragraph."""
    stats = hub.statistics()
    now = time.time()
    busy = timeline.in_flight()
    parts = []
    for task, t in stats.tasks.items():
        doing = "idle"
        if busy.get(task):
            starts = busy[task]
            doing = f"{len(starts)} batch(es) in hand, the oldest for {now - min(starts):.1f}s"
        parts.append(f"{task}: {t.ready} ready, {t.leased} leased, {t.consumed} consumed ({doing})")
    return (
        f"Hub at policy version {stats.version}, {stats.live} of {stats.capacity} samples "
        f"live, stream {'ended' if stats.ended else 'open'}; per task: " + "; ".join(parts)
    )
