"""Timeline: an observer that turns the hub's event stream into stage activity spans.

A span runs from a ``Claimed`` event to the ``Acked``/``Released``/``LeaseExpired`` that
settles the same lease, on the lane of the claiming task (a stage). From the spans it
computes busy fractions and draws the activity picture (PNG).
"""

from __future__ import annotations

import threading
from typing import final

from flowrl.events import Acked, Claimed, Event, LeaseExpired, Released, VersionPublished
from flowrl.hooks import Observer

__all__ = ["Timeline"]


@final
class Timeline(Observer):
    """Collects ``(start, end)`` spans per task; subscribe it with ``hub.subscribe``."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[str, float, str]] = {}
        self._spans: dict[str, list[tuple[float, float, str]]] = {}
        self._versions: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, Claimed):
                self._open[event.lease] = (event.task, event.t, event.consumer)
            elif isinstance(event, Acked | Released | LeaseExpired):
                opened = self._open.pop(event.lease, None)
                if opened is not None:
                    task, start, consumer = opened
                    self._spans.setdefault(task, []).append((start, event.t, consumer))
            elif isinstance(event, VersionPublished):
                self._versions.append((event.t, event.version))

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        with self._lock:
            return {t: [(a, b) for a, b, _ in s] for t, s in self._spans.items()}

    def busy_fraction(self, task: str, start: float, end: float) -> float:
        """Share of ``[start, end]`` during which at least one lease of ``task`` was open."""
        spans = sorted(self.spans().get(task, []))
        busy, cursor = 0.0, start
        for a, b in spans:
            a, b = max(a, cursor), min(b, end)
            if b > a:
                busy += b - a
                cursor = b
        return busy / (end - start) if end > start else 0.0

    def save_png(self, path: str, *, title: str = "stage activity") -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with self._lock:
            spans = {t: list(s) for t, s in self._spans.items()}
            versions = list(self._versions)
        if not spans:
            raise ValueError("Timeline.save_png: no activity was recorded")
        t0 = min(a for s in spans.values() for a, _, _ in s)
        tasks = list(spans)
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(tasks) + 1.6))
        colors = plt.get_cmap("tab10")
        for row, task in enumerate(tasks):
            lanes = sorted({c for _, _, c in spans[task]})
            height = 0.8 / max(len(lanes), 1)
            for a, b, consumer in spans[task]:
                lane = lanes.index(consumer)
                ax.broken_barh(
                    [(a - t0, max(b - a, 1e-4))],
                    (row - 0.4 + lane * height, height * 0.9),
                    color=colors(row % 10),
                )
        for t, _ in versions:
            ax.axvline(t - t0, color="0.75", lw=0.6, zorder=0)
        ax.set_yticks(range(len(tasks)), tasks)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (grey lines: policy version published)")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
