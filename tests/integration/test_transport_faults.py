"""A multi-process hub's client when the controller dies or restarts, and the indices its
producer threads reserve ahead (issue 16: F3, F4, F5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._transport import pools
from flowrl.errors import HubFull, TransportError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COLS = [Column.scalar("x", "int64")]
TASKS = {"train": ["x"]}
#: Longest a call may take to come back (a hang is what these tests catch).
HANG_S = 60.0


def launch(capacity: int, journal: Path | None = None, rpc_timeout: float = 1.0) -> Any:
    config = HubConfig(
        capacity=capacity,
        lease_timeout=30.0,
        journal=None if journal is None else JournalConfig(path=str(journal)),
    )
    hub = flowrl.launch_hub(COLS, tasks=TASKS, config=config)
    hub.rpc_timeout = rpc_timeout
    return hub


def controller_pid(hub: Any) -> int:
    return int(hub.servers.procs[-1].pid)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; the list gets its result or its exception."""
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # surfaced by the test
            out.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("call", ["put", "claim"])
def test_a_call_waiting_without_timeout_raises_when_the_controller_dies(call: str) -> None:
    """F3: a put waiting for room (or a claim waiting for samples) with ``timeout=None``
    on a hub whose controller dies (no journal: nothing restarts it) raises
    TransportError after about ``rpc_timeout``; it used to wait for ever."""
    hub = launch(capacity=8)
    try:
        if call == "put":
            hub.put({"x": np.arange(8)})  # full
            thread, out = in_thread(lambda: hub.put({"x": [8]}, timeout=None))
        else:
            thread, out = in_thread(lambda: hub.claim("train", 1, timeout=None))
        time.sleep(0.5)  # parked in the controller
        assert thread.is_alive()
        os.kill(controller_pid(hub), signal.SIGKILL)
        thread.join(HANG_S)
        assert not thread.is_alive(), f"{call}(timeout=None) still waits on a dead controller"
        (outcome,) = out
        assert isinstance(outcome, TransportError), outcome
        assert "controller did not answer" in str(outcome)
    finally:
        hub.close()


def test_a_put_waiting_for_room_is_sent_again_after_a_controller_restart(
    tmp_path: Path,
) -> None:
    """F3: a producer blocked on a full journaled hub when its controller is SIGKILLed:
    the restarted controller never knew the waiting put; the client finds out (its ping
    is answered "not parked") and sends it again, so it completes once room is freed."""
    hub = launch(capacity=8, journal=tmp_path, rpc_timeout=5.0)
    try:
        hub.put({"x": np.arange(8)})
        thread, out = in_thread(lambda: hub.put({"x": [100]}, timeout=None))
        time.sleep(0.5)
        assert thread.is_alive()  # parked: the hub is full
        os.kill(controller_pid(hub), signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while hub.servers.restarts < 1:
            assert time.monotonic() < deadline, "the supervisor did not restart the controller"
            time.sleep(0.05)
        while True:  # room, once the restarted controller answers
            try:
                hub.ack(hub.claim("train", 8, timeout=5))
                break
            except TransportError:
                assert time.monotonic() < deadline
        thread.join(HANG_S)
        assert not thread.is_alive(), "the waiting put was never sent again"
        (outcome,) = out
        assert isinstance(outcome, np.ndarray), outcome
        meta = hub.claim("train", 1, timeout=5)
        assert hub.get(meta)["x"].tolist() == [100]
    finally:
        hub.close()


def test_put_async_pending_at_a_controller_crash_fail_together() -> None:
    """F4: put_async requests unanswered when the controller crashes all fail once one
    of them went unanswered for ``rpc_timeout`` (16 of them used to take 16 timeouts)."""
    hub = launch(capacity=4096, rpc_timeout=1.0)
    try:
        hub.put({"x": [0]})  # this thread's pool of indices reserved ahead
        pid = controller_pid(hub)
        os.kill(pid, signal.SIGSTOP)  # the commits the unit hands on go unanswered
        futures = [hub.put_async({"x": [k]}) for k in range(16)]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TransportError):
            futures[0].result()
        assert all(f.done() for f in futures), "later puts still wait, one timeout each"
        for f in futures:
            assert isinstance(f.exception(), TransportError)
        assert "producer= and seq=" in " ".join(getattr(futures[0].exception(), "__notes__", []))
    finally:
        hub.close()


def test_an_unanswered_put_says_it_may_have_landed() -> None:
    """A put whose answer never came may have been committed: its error says so, and how
    to re-send it safely (``producer=``/``seq=``); an idempotent put's does not need to."""
    hub = launch(capacity=64, rpc_timeout=1.0)
    pid = controller_pid(hub)
    try:
        hub.put({"x": [0]})
        os.kill(pid, signal.SIGSTOP)  # the commit the unit hands on goes unanswered
        with pytest.raises(TransportError, match="did not answer") as info:
            hub.put({"x": [1]})
        assert "producer= and seq=" in " ".join(getattr(info.value, "__notes__", []))
        with pytest.raises(TransportError) as info:
            hub.put({"x": [2]}, producer="p", seq=0)
        assert not getattr(info.value, "__notes__", [])
    finally:
        os.kill(pid, signal.SIGCONT)
        hub.close()


def test_threads_that_end_give_their_reserved_indices_back() -> None:
    """F5: each producer thread reserves indices ahead; 63 short-lived threads used to
    strand 63 pools (1,953 of 2,048 slots). A thread's pool is given back when it ends."""
    hub = launch(capacity=2048, rpc_timeout=30.0)
    try:
        for k in range(63):
            thread = threading.Thread(target=hub.put, args=({"x": [k]},))
            thread.start()
            thread.join()
        hub.put({"x": [63]})  # this reserve gives the ended threads' pools back
        stats = hub.statistics()
        assert stats.live == 64
        assert stats.reserved_ahead <= pools.RESERVE_AHEAD  # this thread's pool only
    finally:
        hub.close()


def test_a_full_hub_takes_back_indices_reserved_ahead_before_refusing_a_put() -> None:
    """F5: indices reserved ahead by producers that are idle (here: a client that never
    puts again and never closes) do not make the hub full."""
    hub = launch(capacity=2048, rpc_timeout=30.0)
    idle = flowrl.connect(hub.address)
    try:
        idle.put({"x": [0]})  # keeps a pool of indices reserved ahead
        assert hub.statistics().reserved_ahead > 0
        room = hub.statistics().capacity - 1
        assert hub.put_nowait({"x": np.arange(room)}).size == room
        assert hub.statistics().reserved_ahead == 0
        with pytest.raises(HubFull):
            hub.put_nowait({"x": [1]})
        hub.ack(hub.claim("train", 1, timeout=5))  # room for one
        # the idle client's pooled index was taken back: refused, it reserves afresh
        assert idle.put({"x": [1]}, timeout=5).size == 1
    finally:
        idle.close()
        hub.close()


def test_a_pooled_put_async_made_again_after_a_restart_puts_the_bytes_it_was_given(
    tmp_path: Path,
) -> None:
    """A put_async through lent memory keeps no private copy of the caller's arrays: if
    its pooled indices are gone (the controller restarted from its journal) it is made
    again from the bytes it lent, not from the arrays, which the caller has changed."""
    width = 4096  # 32 KiB a sample: lent memory
    cols = [Column.tensor("big", "int64", (width,))]
    config = HubConfig(capacity=4096, journal=JournalConfig(path=str(tmp_path)))
    hub = flowrl.launch_hub(cols, tasks={"train": ["big"]}, config=config)
    hub.rpc_timeout = 5.0
    try:
        data = {"big": np.full((4, width), 7, dtype=np.int64)}
        hub.put_async(data).result(HANG_S)  # reserves the next puts' indices with its own
        assert hub._control._local.pool.left() >= 4
        os.kill(controller_pid(hub), signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while hub.servers.restarts < 1:
            assert time.monotonic() < deadline, "the supervisor did not restart the controller"
            time.sleep(0.05)
        while True:  # the restarted controller answers
            try:
                hub.statistics()
                break
            except TransportError:
                assert time.monotonic() < deadline
        data = {"big": np.full((4, width), 8, dtype=np.int64)}
        fut = hub.put_async(data)  # to pooled indices the new controller never reserved
        pooled = fut.indices.copy()
        data["big"][:] = -1
        indices = fut.result(HANG_S)
        assert not np.array_equal(indices, pooled)  # made again, under new indices
        meta = hub.claim("train", 8, timeout=5)
        got = hub.get(meta)["big"]
        assert sorted(int(row[0]) for row in got) == [7] * 4 + [8] * 4
        assert all((row == row[0]).all() for row in got)
    finally:
        hub.close()


def test_a_new_threads_first_put_is_answered_even_before_its_connection_is_known() -> None:
    """A put whose storage unit hands its commit on is answered by the controller on the
    producer's controller socket; a new thread's socket may not be connected there yet
    (a ROUTER drops what it cannot route). 300 fresh sockets, each thread's first contact
    with the controller that answer, on a machine kept busy: 4-5 were lost before."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    hub = launch(capacity=1024, rpc_timeout=3.0)
    try:
        n = 300
        hub.put({"x": np.arange(n)})
        metas = [hub.claim("train", 1, timeout=5) for _ in range(n)]
        outcomes: list[BaseException | None] = []
        keep = threading.Event()

        def first_put(meta: Any) -> None:
            try:
                hub.put({"x": np.array([7])}, indices=meta)
                outcomes.append(None)
            except BaseException as exc:  # reported below
                outcomes.append(exc)
            keep.wait(HANG_S)  # (its sockets stay its own: the next thread opens new ones)

        threads = [threading.Thread(target=first_put, args=(m,), daemon=True) for m in metas]
        for thread in threads:
            thread.start()
            time.sleep(0.002)
        deadline = time.monotonic() + HANG_S
        while len(outcomes) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        keep.set()
        failed = [o for o in outcomes if o is not None]
        assert len(outcomes) == n and not failed, f"{len(failed)} of {n} failed: {failed[:2]}"
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        hub.close()


def test_puts_right_after_a_controller_restart_are_answered(tmp_path: Path) -> None:
    """Right after a journaled controller restarts, the client's sockets and the storage
    unit's reconnect to it each in their own time. A put to a claim's samples goes to the
    unit, which hands its commit on; the controller used to drop the answer when the
    unit's socket reconnected before the producer's (the put failed after rpc_timeout)."""
    hub = launch(capacity=1024, journal=tmp_path, rpc_timeout=5.0)
    try:
        n = 24
        hub.put({"x": np.arange(2 * n)})
        metas = [hub.claim("train", 1, timeout=5) for _ in range(2 * n)]
        go, outcomes = threading.Event(), []

        def producer(first: Any, second: Any) -> None:
            try:
                hub.put({"x": np.array([1])}, indices=first)  # (its sockets are connected)
                go.wait(HANG_S)
                hub.put({"x": np.array([2])}, indices=second)
                outcomes.append(None)
            except BaseException as exc:  # reported below
                outcomes.append(exc)

        threads = [
            threading.Thread(target=producer, args=(metas[2 * k], metas[2 * k + 1]), daemon=True)
            for k in range(n)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        os.kill(controller_pid(hub), signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while hub.servers.restarts < 1:
            assert time.monotonic() < deadline, "the supervisor did not restart the controller"
            time.sleep(0.01)
        go.set()
        for thread in threads:
            thread.join(HANG_S)
        failed = [o for o in outcomes if o is not None]
        assert len(outcomes) == n and not failed, f"{len(failed)} of {n} failed: {failed[:2]}"
    finally:
        hub.close()
