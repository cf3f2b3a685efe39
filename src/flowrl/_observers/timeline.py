"""Timeline: an observer that turns the hub's event stream into stage activity spans.

A span runs from a ``Claimed`` event to the ``Acked``/``Released``/``LeaseExpired`` that
settles the same lease, on the lane of the claiming task (a stage). From the spans it
computes busy fractions and draws the activity picture (PNG).

The picture is meant to be read at a glance: one lane per task (a sub-lane per consumer
inside it), its label saying how busy the task was; each pixel column of a lane is shaded
by the share of that instant range the consumer had work in hand, so a lane busy 9 % of
the time looks mostly empty however many short spans it has; published policy versions
are ticks on a thin strip above the lanes, never lines across them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, final

import numpy as np

from flowrl.events import Acked, Claimed, Event, LeaseExpired, Released, VersionPublished
from flowrl.hooks import Observer

if TYPE_CHECKING:  # matplotlib is imported only to draw
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Timeline"]

_PIXELS = 1000  # time bins across a lane (about one per pixel column of the saved PNG)


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

    def in_flight(self) -> dict[str, list[float]]:
        """Start times (``time.time()``) of the leases each task holds right now."""
        with self._lock:
            out: dict[str, list[float]] = {}
            for task, start, _ in self._open.values():
                out.setdefault(task, []).append(start)
            return out

    def busy_fraction(self, task: str, start: float, end: float) -> float:
        """Share of ``[start, end]`` during which at least one lease of ``task`` was open."""
        return _busy(self.spans().get(task, []), start, end)

    def figure(self, *, title: str = "stage activity") -> Figure:
        """The activity picture as a matplotlib ``Figure`` (see the module docstring)."""
        from matplotlib.figure import Figure

        with self._lock:
            spans = {t: list(s) for t, s in self._spans.items()}
            versions = list(self._versions)
        if not spans:
            raise ValueError("Timeline.figure: no activity was recorded")
        t0 = min(a for s in spans.values() for a, _, _ in s)
        t1 = max([b for s in spans.values() for _, b, _ in s] + [t for t, _ in versions])
        t1 = max(t1, t0 + 1e-3)
        lanes = [(task, sorted({c for _, _, c in spans[task]})) for task in spans]
        rows = sum(len(consumers) for _, consumers in lanes)
        fig = Figure(figsize=(11, 1.9 + 0.28 * rows + 0.25 * len(lanes)), layout="constrained")
        strip, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 2 + rows]})
        _draw_lanes(ax, spans, lanes, t0, t1)
        _draw_versions(strip, versions, t0)
        rate = f", {len(versions) / (t1 - t0):.1f}/s" if versions else ""
        strip.set_title(f"{title} ({len(versions)} policy versions published{rate})")
        ax.set_xlim(0, t1 - t0)
        ax.set_xlabel("seconds since the first claim")
        fig.legend(handles=_legend(), loc="outside lower center", ncol=4, frameon=False)
        return fig

    def save_png(self, path: str, *, title: str = "stage activity") -> None:
        """Write :meth:`figure` to ``path`` as a PNG."""
        fig = self.figure(title=title)
        fig.savefig(path, dpi=110)


def _busy(spans: list[tuple[float, float]], start: float, end: float) -> float:
    busy, cursor = 0.0, start
    for a, b in sorted(spans):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            busy += b - a
            cursor = b
    return busy / (end - start) if end > start else 0.0


def occupancy(spans: list[tuple[float, float]], t0: float, t1: float, bins: int) -> np.ndarray:
    """Per bin of ``[t0, t1]``, the share of it covered by the union of ``spans``."""
    edges = np.linspace(t0, t1, bins + 1)
    width = edges[1] - edges[0]
    covered = np.zeros(bins)
    cursor = t0
    for a, b in sorted(spans):
        a, b = max(a, cursor), min(b, t1)
        if b <= a:
            continue
        cursor = b
        first, last = np.searchsorted(edges, [a, b], side="right") - 1
        last = min(last, bins - 1)
        lo = np.maximum(edges[first : last + 1], a)
        hi = np.minimum(edges[first + 1 : last + 2], b)
        covered[first : last + 1] += np.clip(hi - lo, 0.0, None)
    return np.clip(covered / width, 0.0, 1.0)


def _draw_lanes(
    ax: Axes,
    spans: dict[str, list[tuple[float, float, str]]],
    lanes: list[tuple[str, list[str]]],
    t0: float,
    t1: float,
) -> None:
    import matplotlib as mpl
    from matplotlib.colors import LinearSegmentedColormap, to_hex

    colors = mpl.colormaps["tab10"]
    labels, ticks = [], []
    y = 0.0
    for k, (task, consumers) in enumerate(lanes):
        color = colors(k % 10)
        cmap = LinearSegmentedColormap.from_list(task, ["white", to_hex(color)])
        busy = _busy([(a, b) for a, b, _ in spans[task]], t0, t1)
        top = y
        for consumer in consumers:
            mine = [(a, b) for a, b, c in spans[task] if c == consumer]
            occ = occupancy(mine, t0, t1, _PIXELS)
            ax.imshow(
                occ[None, :],
                extent=(0, t1 - t0, y + 0.9, y + 0.1),
                cmap=cmap,
                vmin=0.0,
                vmax=1.0,
                aspect="auto",
                interpolation="nearest",
            )
            y += 1.0
        workers = f" x{len(consumers)}" if len(consumers) > 1 else ""
        labels.append(f"{task}{workers}  busy {busy:.0%}")
        ticks.append((top + y) / 2)
        if k < len(lanes) - 1:
            ax.axhline(y + 0.125, color="0.85", lw=0.5)
        y += 0.25
    ax.set_ylim(y - 0.25, 0)
    ax.set_yticks(ticks, labels)
    ax.tick_params(axis="y", length=0)


def _legend() -> list[Artist]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Patch(color="0.25", label="stage had work in hand"),
        Patch(color="0.75", label="part of the time (shade = share)"),
        Patch(facecolor="white", edgecolor="0.6", label="idle"),
        Line2D([], [], color="0.35", lw=1, label="policy version published (top strip)"),
    ]


def _draw_versions(strip: Axes, versions: list[tuple[float, int]], t0: float) -> None:
    strip.vlines([t - t0 for t, _ in versions], 0, 1, color="0.35", lw=0.6)
    strip.set_ylim(0, 1)
    strip.set_yticks([0.5], ["versions"])
    strip.tick_params(axis="y", length=0)
    strip.tick_params(axis="x", labelbottom=False)
    for side in ("left", "right", "top"):
        strip.spines[side].set_visible(False)
