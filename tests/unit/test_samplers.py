"""Sampler invariants (the docstring of ``flowrl._controller.samplers``), then through the hub.

* every sampler returns distinct positions into the view, at most ``n``, as int64;
* FifoSampler takes the oldest ready samples;
* GroupSampler returns only whole groups (every member of each group present);
* StalenessSampler returns only samples with version >= current - max_staleness;
* BalancedSampler.split gives every rank the same count and token totals within one
  sample's tokens of each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl import (
    BalancedSampler,
    CandidateView,
    Column,
    FifoSampler,
    GroupSampler,
    HubConfig,
    Sampler,
    StalenessSampler,
)
from flowrl._controller.table import SampleTable
from flowrl.errors import ConfigError, EndOfStream, NothingReady, Timeout


def make_view(
    groups: list[int], versions: list[int], tokens: list[int], current: int, capacity: int = 64
) -> CandidateView:
    """A CandidateView over a real SampleTable whose samples carry the given metadata."""
    n = len(groups)
    table = SampleTable(capacity)
    table.allocate(3)  # the view's indices need not start at slot 0
    table.free(np.arange(3))
    indices = table.allocate(n) if n else np.empty(0, dtype=np.int64)
    slots = indices % capacity
    table.committed[slots] = True
    table.group[slots] = groups
    table.version[slots] = versions
    table.tokens[slots] = tokens
    return CandidateView(indices, table, current)


@st.composite
def views(draw: Any, max_size: int = 40) -> CandidateView:
    n = draw(st.integers(0, max_size))
    groups = draw(st.lists(st.integers(-1, 6), min_size=n, max_size=n))
    versions = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    current = draw(st.integers(0, 8))
    return make_view(groups, versions, tokens, current)


def check_positions(positions: Any, view: CandidateView, n: int) -> np.ndarray:
    assert isinstance(positions, np.ndarray)
    assert positions.dtype == np.int64
    assert positions.ndim == 1
    assert positions.size <= n
    assert np.unique(positions).size == positions.size
    if positions.size:
        assert positions.min() >= 0
        assert positions.max() < len(view)
    return positions


# -- pure sampler invariants -----------------------------------------------------------------
def test_candidate_view_gathers_table_metadata() -> None:
    view = make_view([5, 6, -1], [1, 2, 3], [10, 20, 30], current=4)
    assert len(view) == 3
    assert view.group.tolist() == [5, 6, -1]
    assert view.version.tolist() == [1, 2, 3]
    assert view.tokens.tolist() == [10, 20, 30]
    sub = view.subset(np.array([2, 0]))
    assert sub.indices.tolist() == [view.indices[2], view.indices[0]]
    assert sub.tokens.tolist() == [30, 10]
    assert sub.group.tolist() == [-1, 5]
    assert sub.current_version == 4


@settings(max_examples=60, deadline=None)
@given(views(), st.integers(1, 50))
def test_fifo_takes_the_oldest(view: CandidateView, n: int) -> None:
    positions = check_positions(FifoSampler().select(view, n), view, n)
    assert positions.tolist() == list(range(min(n, len(view))))


@settings(max_examples=80, deadline=None)
@given(views(), st.integers(1, 5), st.integers(1, 50))
def test_group_sampler_returns_whole_groups_only(view: CandidateView, gs: int, n: int) -> None:
    sampler = GroupSampler(gs)
    if n < gs:
        with pytest.raises(ConfigError, match="group_size"):
            sampler.select(view, n)
        return
    positions = check_positions(sampler.select(view, n), view, n)
    groups = view.group
    chosen = set(groups[positions].tolist())
    assert -1 not in chosen
    for g in chosen:
        members = np.flatnonzero(groups == g)
        assert members.size == gs  # complete
        assert set(members.tolist()) <= set(positions.tolist())  # every member taken
    # as many complete groups as fit, oldest (by first ready member) first
    uniq, first, counts = np.unique(groups, return_index=True, return_counts=True)
    complete = [(f, g) for g, f, c in zip(uniq, first, counts, strict=True) if c == gs and g >= 0]
    expected = {g for _, g in sorted(complete)[: n // gs]}
    assert chosen == expected


@settings(max_examples=80, deadline=None)
@given(views(), st.integers(0, 4), st.integers(1, 50))
def test_staleness_sampler_bounds_versions(view: CandidateView, eta: int, n: int) -> None:
    positions = check_positions(StalenessSampler(eta).select(view, n), view, n)
    assert (view.version[positions] >= view.current_version - eta).all()
    fresh = np.flatnonzero(view.version >= view.current_version - eta)
    assert positions.tolist() == fresh[:n].tolist()  # FIFO among the fresh ones


@settings(max_examples=60, deadline=None)
@given(views(), st.integers(0, 4), st.integers(1, 3), st.integers(1, 30))
def test_staleness_over_groups_keeps_both_invariants(
    view: CandidateView, eta: int, gs: int, k: int
) -> None:
    n = gs * k
    positions = check_positions(StalenessSampler(eta, GroupSampler(gs)).select(view, n), view, n)
    assert (view.version[positions] >= view.current_version - eta).all()
    fresh = view.version >= view.current_version - eta
    for g in set(view.group[positions].tolist()):
        members = np.flatnonzero((view.group == g) & fresh)
        assert members.size == gs
        assert set(members.tolist()) <= set(positions.tolist())


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.integers(0, 4096), max_size=64),
)
def test_balanced_split_is_a_balanced_partition(dp: int, tokens: list[int]) -> None:
    arr = np.array(tokens, dtype=np.int64)
    parts = BalancedSampler(dp).split(arr)
    assert len(parts) == dp
    flat = np.concatenate(parts) if parts else np.empty(0)
    assert sorted(flat.tolist()) == list(range(len(tokens)))  # a partition: each once
    counts = [p.size for p in parts]
    assert max(counts) - min(counts) <= 1
    if len(tokens) % dp == 0:
        assert len(set(counts)) == 1
    for p in parts:
        assert p.tolist() == sorted(p.tolist())
    totals = [int(arr[p].sum()) for p in parts]
    if tokens and len(tokens) % dp == 0:
        assert max(totals) - min(totals) <= max(tokens)


@settings(max_examples=40, deadline=None)
@given(views(), st.integers(1, 4), st.integers(1, 10))
def test_balanced_select_takes_dp_times_n(view: CandidateView, dp: int, n: int) -> None:
    sampler = BalancedSampler(dp)
    positions = check_positions(sampler.select(view, n), view, n * dp)
    assert positions.tolist() == list(range(min(n * dp, len(view))))


@pytest.mark.parametrize(
    "make",
    [
        lambda: GroupSampler(0),
        lambda: GroupSampler("4"),
        lambda: StalenessSampler(-1),
        lambda: StalenessSampler(1.5),
        lambda: BalancedSampler(0),
        lambda: BalancedSampler(None),
    ],
)
def test_sampler_config_is_validated(make: Any) -> None:
    with pytest.raises(ConfigError):
        make()


# -- through the hub ------------------------------------------------------------------------
COLS = [Column.scalar("x", "int64"), Column.scalar("r", "float32")]


def test_group_sampler_through_hub_returns_whole_groups(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x", "r"]})
    # groups 0..3 of 4 members, interleaved over puts; group 2 lacks 'r' on one member
    order = [0, 1, 0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3, 3, 2]
    idx = hub.put({"x": np.array(order, np.int64)}, groups=order)
    late = idx[15]  # the last member of group 2
    rest = np.array([i for i in idx.tolist() if i != late])
    hub.put({"r": np.ones(rest.size, np.float32)}, indices=rest)
    meta = hub.claim("train", 8, sampler=GroupSampler(4), timeout=2)
    assert len(meta) == 8
    groups, counts = np.unique(meta.groups, return_counts=True)
    assert counts.tolist() == [4, 4]
    assert set(groups.tolist()) <= {0, 1, 3}
    batch = hub.get(meta)
    assert batch["x"].tolist() == meta.groups.tolist()  # x was the group id
    # group 2 is incomplete: only one whole group (3) is left
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 8, sampler=GroupSampler(4))
    meta2 = hub.claim("train", 8, sampler=GroupSampler(4), min_n=4, timeout=2)
    assert np.unique(meta2.groups).size == 1
    assert len(meta2) == 4
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 4, sampler=GroupSampler(4))
    hub.put({"r": np.ones(1, np.float32)}, indices=[late])
    meta3 = hub.claim("train", 4, sampler=GroupSampler(4), timeout=2)
    assert meta3.groups.tolist() == [2, 2, 2, 2]
    seen = np.concatenate([meta.indices, meta2.indices, meta3.indices])
    assert sorted(seen.tolist()) == idx.tolist()


def test_group_claim_with_n_not_a_multiple_of_group_size(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put({"x": np.arange(8)}, groups=[0, 0, 0, 0, 1, 1, 1, 1])
    meta = hub.claim("train", 6, sampler=GroupSampler(4), timeout=0.3)
    assert meta.groups.tolist() == [0, 0, 0, 0]


def test_group_sampler_at_end_of_stream(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put({"x": np.arange(6)}, groups=[0, 0, 1, 1, 1, 2])
    hub.end_stream()
    meta = hub.claim("train", 4, sampler=GroupSampler(3), timeout=2)
    assert meta.groups.tolist() == [1, 1, 1]  # partial batch at end of stream
    hub.ack(meta)
    with pytest.raises(EndOfStream, match="not selectable"):
        hub.claim("train", 4, sampler=GroupSampler(3), timeout=2)


def test_staleness_sampler_honours_publish_version(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    old = hub.put({"x": np.arange(3)})  # produced at version 0
    hub.publish_version(2)
    assert hub.version == 2
    sampler = StalenessSampler(1)
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1, sampler=sampler)
    mid = hub.put({"x": np.arange(2)}, version=1)  # one version old: allowed
    new = hub.put({"x": np.arange(2)})  # default: the current version
    meta = hub.claim("train", 10, sampler=sampler, min_n=1, timeout=2)
    assert meta.indices.tolist() == mid.tolist() + new.tolist()
    assert meta.versions.tolist() == [1, 1, 2, 2]
    hub.publish_version(3)
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1, sampler=sampler)
    # the stale samples are still there for a sampler that accepts them
    meta = hub.claim("train", 3, sampler=StalenessSampler(3), timeout=2)
    assert meta.indices.tolist() == old.tolist()
    assert meta.versions.tolist() == [0, 0, 0]


def test_staleness_sampler_blocks_until_fresh_data(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put({"x": np.arange(4)})
    hub.publish_version(5)
    with pytest.raises(Timeout):
        hub.claim("train", 2, sampler=StalenessSampler(0), timeout=0.05)
    fresh = hub.put({"x": np.arange(2)}, version=5)
    meta = hub.claim("train", 2, sampler=StalenessSampler(0), timeout=2)
    assert meta.indices.tolist() == fresh.tolist()


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("first_rank", [0, -1])
def test_balanced_sampler_through_hub(make_hub, dp: int, first_rank: int) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    rng = np.random.default_rng(dp)
    n = 3
    rounds = 3
    tokens = rng.integers(1, 2000, size=n * dp * rounds)
    idx = hub.put({"x": np.arange(tokens.size)}, tokens=tokens)
    sampler = BalancedSampler(dp)
    delivered: list[int] = []
    for r in range(rounds):
        ranks = list(range(dp))
        if first_rank == -1:
            ranks.reverse()
        metas = {
            rank: hub.claim("train", n, sampler=sampler, dp_rank=rank, timeout=2) for rank in ranks
        }
        global_batch = idx[r * n * dp : (r + 1) * n * dp]  # FIFO inner: the oldest n * dp
        parts = [metas[k].indices.tolist() for k in range(dp)]
        assert all(len(p) == n for p in parts)  # equal counts
        flat = [i for p in parts for i in p]
        assert len(set(flat)) == len(flat)  # never overlapping
        assert sorted(flat) == global_batch.tolist()  # each sample reaches exactly one rank
        sums = [int(metas[k].tokens.sum()) for k in range(dp)]
        assert max(sums) - min(sums) <= int(tokens[global_batch - idx[0]].max())
        for k in range(dp):
            assert metas[k].dp_rank == k
            assert metas[k].tokens.tolist() == tokens[metas[k].indices - idx[0]].tolist()
            hub.ack(metas[k])
        delivered += flat
    assert sorted(delivered) == idx.tolist()
    assert hub.statistics().live == 0


def test_balanced_sampler_rank_waits_for_a_full_global_batch(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put({"x": np.arange(3)}, tokens=[5, 6, 7])
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 2, sampler=BalancedSampler(2), dp_rank=1)
    hub.put({"x": np.arange(1)}, tokens=[8])
    m1 = hub.claim("train", 2, sampler=BalancedSampler(2), dp_rank=1, timeout=2)
    m0 = hub.claim("train", 2, sampler=BalancedSampler(2), dp_rank=0, timeout=2)
    assert sorted(m0.indices.tolist() + m1.indices.tolist()) == [0, 1, 2, 3]
    assert int(m0.tokens.sum()) == int(m1.tokens.sum()) == 13  # snake: 8+5 vs 7+6


def test_balanced_part_of_a_rank_that_never_comes_is_returned(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]}, config=HubConfig(lease_timeout=0.5))
    hub.put({"x": np.arange(4)}, tokens=[1, 2, 3, 4])
    m0 = hub.claim("train", 2, sampler=BalancedSampler(2), dp_rank=0, timeout=2)
    hub.ack(m0)
    # rank 1 never claims its part; once the lease runs out it is deliverable again
    again = hub.claim("train", 2, timeout=2)
    assert sorted(again.indices.tolist() + m0.indices.tolist()) == [0, 1, 2, 3]


class _Raising(Sampler):
    def select(self, view: CandidateView, n: int) -> np.ndarray:
        raise RuntimeError("policy bug")


class _Invalid(Sampler):
    def select(self, view: CandidateView, n: int) -> np.ndarray:
        return np.zeros(min(2, len(view)), dtype=np.int64)  # repeats position 0


def test_a_raising_sampler_fails_the_claim_and_the_hub_keeps_working(
    make_hub, placement: str
) -> None:
    if placement != "inproc":
        pytest.skip("custom samplers run only on the in-process hub")
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put({"x": np.arange(4)})
    before = hub.statistics()
    with pytest.raises(RuntimeError, match="policy bug"):
        hub.claim("train", 2, sampler=_Raising(), timeout=1)
    with pytest.raises(ConfigError, match="invalid positions"):
        hub.claim("train", 2, sampler=_Invalid(), timeout=1)
    assert hub.statistics() == before
    assert hub.claim("train", 4, timeout=2).indices.tolist() == [0, 1, 2, 3]
