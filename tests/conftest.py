"""Shared fixtures: ``make_hub`` builds a hub under every placement in ``PLACEMENTS``.

Behaviour tests take ``make_hub`` and use only the public client API (``flowrl.*`` and hub
methods), never ``hub.controller`` or other internals, so the same test runs unchanged
in-process and over zmq. Every hub a test made is closed at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pytest

import flowrl

PLACEMENTS = ["inproc", "zmq"]


def _inproc(
    columns: Iterable[flowrl.Column],
    tasks: Mapping[str, Sequence[str]] | None,
    config: flowrl.HubConfig | None,
) -> Any:
    return flowrl.Hub(columns, tasks=dict(tasks) if tasks else None, config=config)


def _zmq(
    columns: Iterable[flowrl.Column],
    tasks: Mapping[str, Sequence[str]] | None,
    config: flowrl.HubConfig | None,
) -> Any:
    launch = getattr(flowrl, "launch_hub", None)
    if launch is None:
        pytest.skip("flowrl.launch_hub is not available yet")
    return launch(columns=list(columns), tasks=dict(tasks) if tasks else None, config=config)


FACTORIES: dict[str, Callable[..., Any]] = {"inproc": _inproc, "zmq": _zmq}

MakeHub = Callable[..., Any]


@pytest.fixture(params=PLACEMENTS)
def placement(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_hub(placement: str) -> Iterator[MakeHub]:
    """``make_hub(columns=[...], tasks={...}, config=HubConfig(...))`` -> a hub client."""
    made: list[Any] = []
    factory = FACTORIES[placement]

    def make(
        columns: Iterable[flowrl.Column] = (),
        tasks: Mapping[str, Sequence[str]] | None = None,
        config: flowrl.HubConfig | None = None,
    ) -> Any:
        hub = factory(tuple(columns), tasks, config)
        made.append(hub)
        return hub

    yield make
    errors: list[BaseException] = []
    for hub in reversed(made):
        try:
            hub.close()
        except Exception as exc:  # close every hub even if one fails, then report
            errors.append(exc)
    if errors:
        raise errors[0]
