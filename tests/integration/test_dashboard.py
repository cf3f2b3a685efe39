"""The live page in a real headless browser (Debian's chromium, driven by selenium through
chromedriver): it updates while a pipeline runs, its numbers move, and they match the
hub's statistics. A screenshot is saved as an artifact (``FLOWRL_TEST_ARTIFACTS`` or the
test's temporary folder). Skipped where chromium, chromedriver or selenium is absent;
.ci/run installs them."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
N = 256


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install ...)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,950",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _number(driver: Any, element: str) -> int:
    """The number the page shows in ``#element`` (-1 before it exists); read in one
    script call, since the page rebuilds its table rows at every update."""
    script = "const e = document.getElementById(arguments[0]); return e ? e.textContent : ''"
    value = driver.execute_script(script, element)
    return int(value) if value.strip().isdigit() else -1


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"the page never showed {what}")
        time.sleep(0.1)


def test_the_page_updates_live_and_matches_the_hub(browser: Any, tmp_path: Path) -> None:
    go = threading.Event()

    @flowrl.stage(outputs=[Column.ragged("response", "int64")], batch_size=8)
    def rollout():
        go.wait(60)  # start once the page is open
        for start in range(0, N, 8):
            time.sleep(0.05)  # a rollout that takes a while, so the page sees it move
            yield {"response": [np.arange(i % 9 + 1) for i in range(start, start + 8)]}

    @flowrl.stage(inputs=["response"], outputs=[Column.scalar("reward", "float32")], batch_size=8)
    def reward(batch):
        return {"reward": batch.ragged("response").lengths.astype(np.float32)}

    pipe = flowrl.Pipeline([rollout, reward])
    hub = flowrl.Hub(pipe.columns)
    pipe.register(hub)
    loader = flowrl.Loader(hub, task="train", columns=["response", "reward"], batch_size=16)
    with flowrl.serve_dashboard(hub, loaders=[loader], interval=0.25) as dashboard:
        run = pipe.start(hub, loaders=[loader])
        browser.get(dashboard.url)
        _wait(lambda: _number(browser, "updates") >= 2, "its first updates")
        go.set()
        seen = []
        for step, batch in enumerate(loader):
            dashboard.log(
                {"reward": float(batch.numpy("reward").mean()), "loss": 1.0 / (step + 1)}, step
            )
            seen.append(_number(browser, "acked-train"))
        run.result(timeout=60)
        loader.close()
        final = hub.statistics()
        # the page is at most an interval behind: it ends on the hub's own figures
        _wait(lambda: _number(browser, "acked-reward") == N, "every reward acked")
        _wait(lambda: _number(browser, "acked-train") == N, "every sample trained")
        _wait(lambda: _number(browser, "live") == final.live, f"live = {final.live}")
        assert _number(browser, "ready-reward") == final.tasks["reward"].ready
        assert _number(browser, "version") == final.version
        moved = sorted({v for v in seen if v >= 0})
        assert len(moved) >= 3, f"the acked count hardly moved during the run: {moved}"
        state = json.loads(urllib.request.urlopen(dashboard.url + "state", timeout=10).read())
        assert state["tasks"]["train"]["acked"] == N
        assert len(state["curves"]["reward"]) == N // 16
        assert state["strip"]["columns"] == ["response", "reward"]
        folder = Path(os.environ.get("FLOWRL_TEST_ARTIFACTS", tmp_path))
        folder.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(folder / "dashboard.png"))
        assert (folder / "dashboard.png").stat().st_size > 10_000
    hub.close()


def test_the_page_polls_statistics_and_follows_no_event() -> None:
    hub = flowrl.Hub(columns=[Column.scalar("x", "float32")], tasks={"t": ["x"]})
    # the hub seen through statistics() alone: a page following its events fails on it
    with hub, flowrl.serve_dashboard(SimpleNamespace(statistics=hub.statistics)) as page:
        hub.put({"x": np.zeros(5, dtype=np.float32)})
        hub.ack(hub.claim("t", 3))
        state = json.loads(urllib.request.urlopen(page.url + "state", timeout=10).read())
        stats = hub.statistics()
    t = stats.counters.tasks["t"]
    assert state["tasks"]["t"] == {
        "ready": 2,
        "leased": 0,
        "consumed": 3,
        "claimed": 3,
        "acked": 3,
        "released": 0,
        "expired": 0,
        "busy_s": round(t.busy_s, 4),
    }
    assert state["staleness"]["tasks"]["t"] == list(t.staleness)
    assert state["strip"] == {"columns": ["x"], "indices": [3, 4], "ready": [[1, 1]]}


def test_bad_arguments_are_refused() -> None:
    with flowrl.Hub(columns=[Column.scalar("x", "float32")]) as hub:
        with pytest.raises(ConfigError, match="expected seconds in"):
            flowrl.serve_dashboard(hub, interval=5)
        with pytest.raises(ConfigError, match="expected an int in"):
            flowrl.serve_dashboard(hub, port=-1)


@pytest.mark.parametrize("host", [None, "127.0.0.1"], ids=["ipc", "tcp-with-key-file"])
def test_flowrl_dashboard_serves_a_launched_hub(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, host: str | None
) -> None:
    from flowrl.__main__ import dashboard

    hub = flowrl.launch_hub([Column.scalar("x", "int64")], tasks={"t": ["x"]}, host=host)
    args = ["--hub", hub.address, "--port", "0"]
    if host is not None:  # a hub on TCP admits holders of its key only
        hub.key.save(str(tmp_path / "hub.key"))
        args += ["--key-file", str(tmp_path / "hub.key")]
    stop = threading.Event()
    try:
        hub.put({"x": np.arange(6)})
        hub.ack(hub.claim("t", 4, timeout=5))
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(dashboard(args, stop=stop)))
        thread.start()
        out = ""

        def printed() -> bool:
            nonlocal out
            out += capsys.readouterr().out
            return "flowrl dashboard: http://" in out

        _wait(printed, "its URL")
        url = out.split("flowrl dashboard: ", 1)[1].split()[0]
        state = json.loads(urllib.request.urlopen(url + "state", timeout=10).read())
        assert state["tasks"]["t"]["ready"] == 2 and state["hub"]["live"] == 2
        assert state["tasks"]["t"]["acked"] == 4  # the counters come over zmq too
        assert state["strip"] == {"columns": ["x"], "indices": [4, 5], "ready": [[1, 1]]}
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "<title>flowrl hub</title>" in page
        assert "://" not in page  # nothing fetched from elsewhere: works with no internet
    finally:
        stop.set()
        thread.join(timeout=30)
        hub.close()
    assert done == [0]
