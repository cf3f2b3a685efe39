"""The suite's ``placement`` parametrization leaves a test's own choice alone."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("placement", ["zmq"])
def test_a_test_may_pick_its_own_placement(placement: str) -> None:
    assert placement == "zmq"


@pytest.mark.parametrize("placement", ["inproc"])
def test_its_own_placement_reaches_make_hub(placement: str, make_hub) -> None:
    hub = make_hub(columns=[], tasks={})
    assert hub.version == 0
