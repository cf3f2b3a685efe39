"""A live page of a hub: ``serve_dashboard(hub)`` serves it on loopback.

The page (``dashboard.html``, drawn by its own small script: no CDN, works offline)
listens to ``/stream``, server-sent events carrying one JSON snapshot every ``interval``
seconds while a page is open: the hub's statistics (``hub.statistics()``: queues, the
counters of claims, acks, expiries, busy seconds and staleness per task, and which
columns the newest live samples have ready), the Loaders' wait, the curves logged to it
(it is a :class:`~flowrl.tracking.Tracker`: ``dashboard.log({"reward": r, "loss": l},
step)``) and the recent warnings and errors of flowrl's loggers. ``/state`` answers the
same snapshot once. Snapshots are computed once per interval however many pages are
open, and not at all when none is; the page follows no event of the hub, so between
snapshots it costs the hub nothing.

The server is aiohttp's, in a thread of its own; ``close()`` stops it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, final

from flowrl._config import STALENESS_BUCKETS
from flowrl._observers.sources import HubLike, LoaderLike, check_port
from flowrl.errors import ConfigError
from flowrl.tracking import Tracker

__all__ = ["Dashboard", "serve_dashboard"]

CURVE_POINTS = 1000  # points kept per curve
ERRORS_KEPT = 20


class _RecentErrors(logging.Handler):
    """The last warnings and errors of flowrl's loggers, for the page."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: collections.deque[str] = collections.deque(maxlen=ERRORS_KEPT)

    def emit(self, record: logging.LogRecord) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        self.lines.append(f"{stamp} {record.levelname.lower()}: {record.getMessage()}")


@final
class Dashboard(Tracker):
    """A running page (see :func:`serve_dashboard`): ``url``, ``log``, ``close``."""

    def __init__(
        self,
        hub: HubLike,
        *,
        loaders: Sequence[LoaderLike],
        interval: float,
    ) -> None:
        self.hub, self.loaders, self.interval = hub, list(loaders), interval
        self._curves: dict[str, collections.deque[tuple[int, float]]] = {}
        self._curves_lock = threading.Lock()
        self._errors = _RecentErrors()
        logging.getLogger("flowrl").addHandler(self._errors)
        self._snapshot: tuple[float, bytes] = (0.0, b"{}")
        self._snapshot_lock = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="flowrl-dashboard", daemon=True
        )
        self._runner: Any = None
        self.url = ""
        self.port = 0

    # -- a Tracker: curves on the page ---------------------------------------------------
    def log(self, data: Mapping[str, Any], step: int) -> None:
        with self._curves_lock:
            for key, value in data.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    curve = self._curves.setdefault(key, collections.deque(maxlen=CURVE_POINTS))
                    curve.append((step, float(value)))

    def finish(self) -> None:
        """As a sink of a ``Tracking``: the page stays up until :meth:`close`."""

    # -- the snapshot ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What the page shows, as plain data (also ``GET /state``)."""
        now = time.time()
        stats = self.hub.statistics()
        counts = stats.counters.tasks
        tasks = {
            task: {
                "ready": t.ready,
                "leased": t.leased,
                "consumed": t.consumed,
                "claimed": counts[task].claimed,
                "acked": counts[task].acked,
                "released": counts[task].released,
                "expired": counts[task].expired,
                "busy_s": round(counts[task].busy_until(now), 4),
            }
            for task, t in sorted(stats.tasks.items())
        }
        staleness = {task: list(c.staleness) for task, c in sorted(counts.items())}
        readiness = stats.counters.readiness
        strip = [[int(bit) for bit in bits] for bits in readiness.ready.values()]
        with self._curves_lock:
            curves = {k: [list(p) for p in v] for k, v in self._curves.items()}
        loaders = {}
        for loader in self.loaders:
            s = loader.statistics()
            loaders[loader.task] = {"wait_s": round(s.wait_s, 4), "batches": s.batches}
        return {
            "t": now,
            "hub": {
                "live": stats.live,
                "capacity": stats.capacity,
                "leases": stats.leases,
                "version": stats.version,
                "ended": stats.ended,
            },
            "tasks": tasks,
            "staleness": {
                "buckets": [str(b) for b in STALENESS_BUCKETS] + ["more"],
                "tasks": staleness,
            },
            "strip": {
                "columns": list(readiness.ready),
                "indices": list(readiness.indices),
                "ready": strip,
            },
            "curves": curves,
            "loaders": loaders,
            "errors": list(self._errors.lines),
        }

    async def _fresh(self) -> bytes:
        """The snapshot, computed at most once per interval for all open pages."""
        async with self._snapshot_lock:
            taken, body = self._snapshot
            if time.monotonic() - taken >= self.interval * 0.9:
                state = await self._loop.run_in_executor(None, self.snapshot)
                body = json.dumps(state).encode()
                self._snapshot = (time.monotonic(), body)
            return body

    # -- the server ------------------------------------------------------------------------
    def _start(self, addr: str, port: int) -> None:
        from aiohttp import web

        page = resources.files("flowrl._observers").joinpath("dashboard.html").read_bytes()

        async def index(request: web.Request) -> web.Response:
            return web.Response(body=page, content_type="text/html")

        async def state(request: web.Request) -> web.Response:
            return web.Response(body=await self._fresh(), content_type="application/json")

        async def stream(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"data: " + await self._fresh() + b"\n\n")
                    await asyncio.sleep(self.interval)
            except (ConnectionResetError, asyncio.CancelledError):
                pass
            return response

        app = web.Application()
        app.add_routes([web.get("/", index), web.get("/state", state), web.get("/stream", stream)])
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._thread.start()

        async def setup() -> int:
            await self._runner.setup()
            site = web.TCPSite(self._runner, addr, port)
            await site.start()
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.port = asyncio.run_coroutine_threadsafe(setup(), self._loop).result(timeout=30)
        self.url = f"http://{addr}:{self.port}/"

    def close(self) -> None:
        """Stop the server."""
        if self._runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            try:
                future.result(timeout=10)
            finally:
                self._runner = None
        if self._thread.is_alive():  # open pages' streams end here, then the loop
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()
        logging.getLogger("flowrl").removeHandler(self._errors)

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_tasks() -> None:
    """Cancel every task of the running loop but this one, and wait for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def serve_dashboard(
    hub: HubLike,
    *,
    port: int = 0,
    addr: str = "127.0.0.1",
    loaders: Sequence[LoaderLike] = (),
    interval: float = 0.5,
) -> Dashboard:
    """Serve a live page of ``hub`` at ``http://addr:port/`` (port 0: a free one; read
    ``.url``). ``loaders``: Loaders whose wait to show; ``interval``: seconds between
    updates (at most 1: the page is never more than a second behind)."""
    try:
        import aiohttp  # noqa: F401
    except ImportError as exc:
        raise ConfigError("serve_dashboard needs aiohttp: pip install 'flowrl[dashboard]'") from exc
    check_port(port, "serve_dashboard")
    if not isinstance(interval, int | float) or not 0.05 <= interval <= 1.0:
        raise ConfigError(f"serve_dashboard(interval={interval!r}): expected seconds in [0.05, 1]")
    dashboard = Dashboard(hub, loaders=loaders, interval=float(interval))
    try:
        dashboard._start(addr, port)
    except OSError as exc:
        dashboard.close()
        raise ConfigError(f"serve_dashboard: cannot listen on {addr}:{port} ({exc})") from exc
    return dashboard
