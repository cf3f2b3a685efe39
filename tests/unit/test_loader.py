"""Loader: DataLoader-like iteration, data-parallel ranks, whole groups, exact resume."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from flowrl import Column, Hub
from flowrl._pipeline.loader import Loader
from flowrl.errors import ConfigError, LeaseError, Timeout

IDS = Column.ragged("ids", "int64")
X = Column.scalar("x", "int64")


def fill(hub: Any, n: int, *, end: bool = True) -> None:
    hub.put({"x": np.arange(n)})
    if end:
        hub.end_stream(["x"])


def test_iterates_like_a_dataloader_and_stops_at_end_of_stream(make_hub: Any) -> None:
    hub = make_hub([X])
    loader = Loader(hub, task="train", columns=["x"], batch_size=4, timeout=5)
    fill(hub, 10)
    batches = list(loader)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert np.concatenate([b.numpy("x") for b in batches]).tolist() == list(range(10))
    with pytest.raises(StopIteration):
        next(loader)
    stats = hub.statistics()
    assert stats.tasks["train"].consumed == 10 and stats.live == 0  # every batch acked
    assert loader.statistics().samples == 10 and loader.statistics().unacked == 0


def test_previous_batch_is_acked_when_the_next_is_requested(make_hub: Any) -> None:
    hub = make_hub([X])
    loader = Loader(hub, task="train", columns=["x"], batch_size=2, timeout=5)
    fill(hub, 6, end=False)
    next(loader)
    assert hub.statistics().tasks["train"].leased == 2
    next(loader)
    assert hub.statistics().tasks["train"].consumed == 2
    loader.ack()
    assert hub.statistics().tasks["train"].consumed == 4
    with pytest.raises(Timeout, match=r"waited 0\.2s for 8 ready samples"):
        Loader(hub, task="other", columns=["x"], batch_size=8, timeout=0.2).__next__()


def test_an_exception_in_the_loop_gives_the_batch_back() -> None:
    hub = Hub([X])
    fill(hub, 4, end=False)
    with pytest.raises(RuntimeError), Loader(hub, task="t", columns=["x"], batch_size=4) as ld:
        for _ in ld:
            raise RuntimeError("step failed")
    assert hub.statistics().tasks["t"].ready == 4  # back in the hub, not lost
    with Loader(hub, task="t", columns=["x"], batch_size=4) as ld:
        next(ld)
    assert hub.statistics().tasks["t"].consumed == 4  # a normal exit acks the last batch


def test_balanced_ranks_are_disjoint_equal_and_token_balanced(make_hub: Any) -> None:
    hub = make_hub([IDS])
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=64)
    ranks = [
        Loader(hub, task="train", columns=["ids"], batch_size=8, dp_rank=r, dp_size=2, balance=True)
        for r in range(2)
    ]
    hub.put({"ids": [np.zeros(n, dtype=np.int64) for n in lengths]})
    hub.end_stream()
    seen: list[list[int]] = [[], []]
    for _ in range(4):  # 4 global batches of 2 x 8 samples
        parts = [next(ranks[0]), next(ranks[1])]
        tokens = [int(p.meta.tokens.sum()) for p in parts]
        assert len(parts[0]) == len(parts[1]) == 8
        assert abs(tokens[0] - tokens[1]) <= int(lengths.max())
        for r, p in enumerate(parts):
            seen[r].extend(p.indices.tolist())
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(64))
    for loader in ranks:  # the task's stream ends once every rank acked its last batch
        loader.ack()
    for loader in ranks:
        with pytest.raises(StopIteration):
            next(loader)


def test_unbalanced_ranks_claim_disjoint_batches() -> None:
    hub = Hub([X])
    ranks = [
        Loader(hub, task="train", columns=["x"], batch_size=3, dp_rank=r, dp_size=3)
        for r in range(3)
    ]
    fill(hub, 18)
    got: list[list[int]] = [[], [], []]
    for _ in range(2):  # each rank trains two steps, in turn
        for r, loader in enumerate(ranks):
            got[r].extend(next(loader).numpy("x").tolist())
    assert all(len(g) == 6 for g in got)
    assert sorted(got[0] + got[1] + got[2]) == list(range(18))


def test_groups_are_whole(make_hub: Any) -> None:
    hub = make_hub([X])
    loader = Loader(hub, task="train", columns=["x"], batch_size=8, groups=4, timeout=5)
    # members of groups 0..5 arrive interleaved; group 5 never completes
    order = np.random.default_rng(1).permutation(np.repeat(np.arange(6), 4)[:-1])
    for g in order:
        hub.put({"x": np.array([int(g)])}, groups=int(g))
    hub.end_stream()
    sizes = []
    for batch in loader:
        groups, counts = np.unique(batch.meta.groups, return_counts=True)
        assert (counts == 4).all()
        sizes.append(len(groups))
    assert sum(sizes) == 5  # the incomplete group is never handed out
    with pytest.raises(ConfigError, match="dividing batch_size=6"):
        Loader(hub, task="t2", columns=["x"], batch_size=6, groups=4)


def _train(loader: Loader, steps: int, trained: list[int]) -> None:
    for _ in range(steps):
        trained.extend(next(loader).indices.tolist())


def _crash(loader: Loader) -> None:
    """The trainer died: nothing is acked or released any more (its claim-ahead thread
    stops where it is; its leases expire in the hub)."""
    prefetch = loader._prefetch
    if prefetch is not None:
        with prefetch._cond:
            prefetch._stopping = True
            prefetch._cond.notify_all()
        prefetch._join()


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("crash_after_extra_steps", [0, 2])
def test_resume_with_ack_on_next_checkpointing_every_step(
    make_hub: Any, crash_after_extra_steps: int, prefetch: int
) -> None:
    """Checkpoint after step 3; crash right away or after more (lost) steps; resume."""
    hub = make_hub([X])
    opts = {"task": "train", "columns": ["x"], "batch_size": 4, "timeout": 10}
    first = Loader(hub, lease_timeout=0.3, prefetch=prefetch, **opts)
    fill(hub, 40)
    kept: list[int] = []  # what the checkpointed model was trained on
    _train(first, 3, kept)
    state = first.state_dict()
    assert state["samples"] == 12 and state["pending"] == kept[-4:]
    lost: list[int] = []
    _train(first, crash_after_extra_steps, lost)  # trained after the checkpoint, then a crash
    # (no close(): the crashed trainer's leases expire and the hub redelivers its batches,
    # those it claimed ahead too)
    if crash_after_extra_steps and prefetch:
        # the thread sends acks: wait until the trained batches' are out (one batch
        # always stays un-acked: the last one handed out)
        _wait_for(lambda: hub.statistics().tasks["train"].consumed >= 12 + len(lost) - 4)
    _crash(first)

    second = Loader(hub, **opts)
    second.load_state_dict(state)
    resumed = [i for batch in second for i in batch.indices.tolist()]
    if crash_after_extra_steps:
        # ack="next" acked all but the last post-checkpoint batch: those are skipped
        skipped = lost[:-4]
        assert set(skipped).isdisjoint(resumed)
        assert sorted(kept + skipped + resumed) == list(range(40))
    else:
        assert sorted(kept + resumed) == list(range(40))
    assert second.state_dict()["samples"] == 12 + len(resumed)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("crash_before_commit", [True, False])
def test_resume_with_ack_on_checkpoint_is_exact(
    make_hub: Any, crash_before_commit: bool, prefetch: int
) -> None:
    """ack='checkpoint': batches after the last checkpoint come back after a crash."""
    hub = make_hub([X])
    opts = {"task": "train", "columns": ["x"], "batch_size": 4, "timeout": 10, "ack": "checkpoint"}
    first = Loader(hub, lease_timeout=0.3, prefetch=prefetch, **opts)
    fill(hub, 24, end=False)
    kept: list[int] = []
    _train(first, 2, kept)
    first.state_dict()  # an earlier checkpoint
    _train(first, 2, kept)
    state = first.state_dict()  # the checkpoint we resume from: covers 4 batches
    if not crash_before_commit:
        _train(first, 1, [])  # acks the checkpointed batches, then one uncommitted step
    consumed = 8 if crash_before_commit else 16
    _wait_for(lambda: hub.statistics().tasks["train"].consumed == consumed)
    _crash(first)

    second = Loader(hub, **opts)  # the restarted trainer; the producers are still running
    second.load_state_dict(state)
    hub.put({"x": np.arange(24, 40)})
    hub.end_stream(["x"])
    resumed = [i for batch in second for i in batch.indices.tolist()]
    assert sorted(kept + resumed) == list(range(40))  # no sample skipped or repeated
    assert second.state_dict()["samples"] == 40  # the final checkpoint
    second.close()  # acks what that checkpoint covers: the task's stream is done
    assert hub.statistics().live == 0


def test_load_state_dict_checks_its_input() -> None:
    hub = Hub([X])
    loader = Loader(hub, task="train", columns=["x"], batch_size=2, dp_rank=1, dp_size=2)
    other = Loader(hub, task="train", columns=["x"], batch_size=2, dp_rank=0, dp_size=2)
    with pytest.raises(ConfigError, match="restore each rank's loader from its own"):
        loader.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match=r"expects what Loader\.state_dict"):
        loader.load_state_dict({"samples": 3})


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"task": ""}, "non-empty str"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"dp_rank": 2, "dp_size": 2}, r"dp_rank must be an int in \[0, dp_size=2\)"),
        ({"timeout": -1}, "timeout must be >= 0"),
        ({"ack": "never"}, "ack must be 'next' or 'checkpoint'"),
        ({"lease_timeout": 0}, "lease_timeout must be > 0"),
        ({"max_staleness": -1}, "max_staleness must be an int >= 0"),
    ],
)
def test_bad_options(kwargs: dict, text: str) -> None:
    opts = {"task": "train", "columns": ["x"], "batch_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=text):
        Loader(Hub([X]), **opts)


def _wait_for(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)


@pytest.mark.parametrize("stop_after", [0, 3])
def test_claim_ahead_hands_out_every_sample_once_and_gives_back_the_rest(
    make_hub: Any, stop_after: int
) -> None:
    """prefetch: batches claimed ahead and never handed out go back on close(), first in
    line; a second loader gets exactly the rest."""
    hub = make_hub([X])
    opts = {"task": "train", "columns": ["x"], "batch_size": 4, "timeout": 10}
    fill(hub, 40)
    first = Loader(hub, prefetch=3, **opts)
    seen = [i for _, batch in zip(range(stop_after + 1), first, strict=False)
            for i in batch.numpy("x").tolist()]  # fmt: skip
    _wait_for(lambda: hub.statistics().tasks["train"].leased >= 4 + 3 * 4)  # it claimed ahead
    first.close()
    stats = hub.statistics().tasks["train"]
    assert stats.leased == 0 and stats.consumed == len(seen)  # handed out: acked; rest back
    with Loader(hub, prefetch=2, **opts) as second:
        rest = [i for batch in second for i in batch.numpy("x").tolist()]
    assert rest[:4] == list(range(len(seen), len(seen) + 4))  # given back first in line
    assert sorted(seen + rest) == list(range(40))  # none lost, none twice
    assert hub.statistics().live == 0


def test_claim_ahead_raises_an_ack_that_failed_in_its_thread() -> None:
    hub = Hub([X])
    fill(hub, 10)
    loader = Loader(hub, task="t", columns=["x"], batch_size=4, prefetch=4, lease_timeout=0.2)
    next(loader)
    _wait_for(lambda: hub.statistics().tasks["t"].leased == 10)  # everything claimed ahead
    time.sleep(0.4)  # every lease expires: the hub will deliver those samples again
    next(loader)  # the thread acks the first batch: too late
    with pytest.raises(LeaseError, match="raise lease_timeout"):
        loader.state_dict()  # (waits for the acks before it)
    with pytest.raises(LeaseError):
        loader.close()  # the batch handed out last: its lease expired too
    assert hub.statistics().tasks["t"].leased == 0  # what it claimed again went back
    with Loader(hub, task="t", columns=["x"], batch_size=4, prefetch=2) as again:
        assert sum(len(b) for b in again) == 10  # nothing was consumed: all come back


def test_bad_prefetch() -> None:
    with pytest.raises(ConfigError, match="prefetch must be an int >= 0"):
        Loader(Hub([X]), task="t", columns=["x"], batch_size=2, prefetch=-1)
