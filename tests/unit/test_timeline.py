"""The timeline picture reads at a glance: lanes shaded by how busy they really were, the
busy share in each lane's label, policy versions as ticks above the lanes (never across).

Before the fix, a lane busy 8.6 % of the time in many short spans was drawn solid (every
span at least one pixel plus its edge), and 200 full-height grey version lines covered
every lane.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowrl import Timeline
from flowrl._observers.timeline import occupancy
from flowrl.events import Acked, Claimed, VersionPublished

pytest.importorskip("matplotlib")

T = 20.0  # seconds of activity


def _timeline() -> Timeline:
    """``busy``: 90 % busy; ``sparse``: 100 spans of 1.72 ms per 0.2 s (8.6 %), all in the
    first half, so the second half of its lane is idle; 200 versions across the whole run."""
    tl = Timeline()
    seq = iter(range(10**6))
    lease = iter(range(10**6))

    def span(task: str, a: float, b: float) -> None:
        n = next(lease)
        tl(Claimed(seq=next(seq), t=a, task=task, lease=n, indices=(0,), consumer=task))
        tl(Acked(seq=next(seq), t=b, task=task, lease=n, indices=(0,)))

    for k in range(20):
        span("busy", k, k + 0.9)
    for k in range(100):
        a = k * 0.1  # only in [0, 10): the sparse lane is idle in [10, 20)
        span("sparse", a, a + 0.0172)
    span("sparse", T - 1e-3, T)  # one blip at the end so both lanes share the time axis
    for v in range(200):
        tl(VersionPublished(seq=next(seq), t=v * T / 200, version=v + 1))
    return tl


def _lane_pixels(tl: Timeline) -> tuple[list[str], dict[str, np.ndarray]]:
    """The rendered RGB pixels of each lane's band, by lane label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = tl.figure()
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3].astype(float) / 255
    ax = fig.axes[1]
    height = rgb.shape[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    bands = {}
    for label, y in zip(labels, ax.get_yticks(), strict=True):
        x0, _ = ax.transData.transform((0, y))
        x1, _ = ax.transData.transform((T, y))
        _, top = ax.transData.transform((0, y - 0.3))
        _, bottom = ax.transData.transform((0, y + 0.3))
        rows = slice(int(height - max(top, bottom)) + 1, int(height - min(top, bottom)))
        bands[label] = rgb[rows, int(x0) + 1 : int(x1) - 1]
    return labels, bands


def _ink(pixels: np.ndarray) -> float:
    """Mean darkness: 0 on white, larger where colour is drawn."""
    return float((1.0 - pixels.min(axis=-1)).mean())


def test_lanes_are_labelled_with_their_busy_share() -> None:
    labels, _ = _lane_pixels(_timeline())
    assert labels == ["busy  busy 90%", "sparse  busy 9%"]


def test_a_sparse_lane_looks_as_busy_as_it_was() -> None:
    _, bands = _lane_pixels(_timeline())
    busy, sparse = _ink(bands["busy  busy 90%"]), _ink(bands["sparse  busy 9%"])
    assert busy > 0.45
    assert sparse < 0.2 * busy  # 8.6 % busy: mostly white, not a solid bar


def test_versions_are_ticks_above_the_lanes_not_lines_across_them() -> None:
    _, bands = _lane_pixels(_timeline())
    sparse = bands["sparse  busy 9%"]
    idle_half = sparse[:, sparse.shape[1] // 2 + 5 : -10]  # no spans there; 100 versions
    assert idle_half.min() > 0.97  # white: no version line crosses the lane


def test_save_png_writes_the_figure(tmp_path: Path) -> None:
    path = tmp_path / "t.png"
    _timeline().save_png(str(path), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_occupancy_is_the_covered_share_of_each_bin() -> None:
    occ = occupancy([(0.0, 0.25), (0.5, 0.55), (0.52, 0.6)], 0.0, 1.0, 4)
    np.testing.assert_allclose(occ, [1.0, 0.0, 0.4, 0.0])
    assert occupancy([], 0.0, 1.0, 3).tolist() == [0.0, 0.0, 0.0]


def test_figure_without_activity_says_so() -> None:
    with pytest.raises(ValueError, match="no activity"):
        Timeline().figure()
