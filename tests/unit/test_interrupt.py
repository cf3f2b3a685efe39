"""A Ctrl-C that lands in a finalizer is swallowed by Python ("Exception ignored"); the
GRPO job's guard remembers it, so the run still stops at the next step."""

from __future__ import annotations

import signal
import sys
import threading

import pytest

from flowrl.recipes.interrupt import CtrlC


class _RaisesSigintWhenCollected:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer


def test_a_ctrl_c_swallowed_by_a_finalizer_is_raised_at_the_next_check(monkeypatch) -> None:
    swallowed: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    before = signal.getsignal(signal.SIGINT)
    with CtrlC() as ctrl_c:
        ctrl_c.check()  # nothing yet
        _RaisesSigintWhenCollected()  # collected at once: its KeyboardInterrupt is lost
        assert swallowed == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_outside_finalizers_raises_where_it_lands() -> None:
    with CtrlC(), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_outside_the_main_thread_the_guard_leaves_signals_alone() -> None:
    seen: list[object] = []

    def body() -> None:
        with CtrlC() as ctrl_c:
            seen.append(signal.getsignal(signal.SIGINT))
            ctrl_c.check()

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]
