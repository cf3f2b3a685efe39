"""Samplers: policies that pick which ready samples a claim receives.

A sampler sees a :class:`CandidateView` — the samples ready for the claiming task and not
yet consumed by it, oldest first — and returns the positions it takes. Samplers are
policies (design principle 10): an exception raised here fails the claim.

Invariants every sampler keeps (tests/unit/test_samplers.py):

* it returns distinct positions into the view, at most ``n`` of them, as an int64 array;
* ``FifoSampler`` takes the oldest ready samples;
* ``GroupSampler`` returns only whole groups (every member of each group present);
* ``StalenessSampler`` returns only samples with ``version >= current_version - max_staleness``;
* ``BalancedSampler.split`` gives every data-parallel rank the same number of samples and
  token totals within one sample's tokens of each other's share under the snake order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import final

import numpy as np

from flowrl._validate import int_in
from flowrl.errors import ConfigError

__all__ = [
    "BalancedSampler",
    "CandidateView",
    "FifoSampler",
    "GroupSampler",
    "Sampler",
    "StalenessSampler",
]


@final
class CandidateView:
    """Ready samples for one claim, oldest first; metadata columns gathered on demand."""

    __slots__ = ("_cache", "_slots", "_table", "current_version", "indices")

    def __init__(self, indices: np.ndarray, table: object, current_version: int) -> None:
        self.indices = indices
        self._slots: np.ndarray | None = None  # (a FIFO claim never needs them)
        self._table = table
        self.current_version = current_version
        self._cache: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.indices.size)

    @property
    def slots(self) -> np.ndarray:
        if self._slots is None:
            self._slots = self.indices % self._table.capacity  # type: ignore[attr-defined]
        return self._slots

    def _field(self, name: str) -> np.ndarray:
        arr = self._cache.get(name)
        if arr is None:
            arr = self._cache[name] = getattr(self._table, name)[self.slots]
        return arr

    @property
    def group(self) -> np.ndarray:
        return self._field("group")

    @property
    def version(self) -> np.ndarray:
        return self._field("version")

    @property
    def tokens(self) -> np.ndarray:
        return self._field("tokens")

    @property
    def partition(self) -> np.ndarray:
        return self._field("partition")

    def subset(self, positions: np.ndarray) -> CandidateView:
        view = CandidateView(self.indices[positions], self._table, self.current_version)
        for key, arr in self._cache.items():
            view._cache[key] = arr[positions]
        return view


class Sampler(ABC):
    """Chooses which candidates a claim takes. Subclass and implement :meth:`select`."""

    def window(self, n: int) -> int | None:
        """How many of the oldest candidates :meth:`select` needs to see (None: all)."""
        return None

    def quota(self, n: int) -> int:
        """The most samples :meth:`select` can return for a claim of ``n`` (a full batch)."""
        return n

    @abstractmethod
    def select(self, view: CandidateView, n: int) -> np.ndarray:
        """Positions (into ``view``) of at most ``n`` distinct samples to claim."""


@final
class FifoSampler(Sampler):
    """First ready, first served."""

    def window(self, n: int) -> int | None:
        return n

    def select(self, view: CandidateView, n: int) -> np.ndarray:
        return np.arange(min(n, len(view)), dtype=np.int64)

    def __repr__(self) -> str:
        return "FifoSampler()"


@final
class GroupSampler(Sampler):
    """Whole GRPO groups only: a group is taken once all ``group_size`` members are ready."""

    def __init__(self, group_size: int) -> None:
        self.group_size = int_in(group_size, 1, "GroupSampler group_size must be a positive int")

    def quota(self, n: int) -> int:
        return n - n % self.group_size

    def select(self, view: CandidateView, n: int) -> np.ndarray:
        if n < self.group_size:
            raise ConfigError(
                f"GroupSampler(group_size={self.group_size}) cannot fill a claim of n={n}; "
                "claim at least one group's worth of samples"
            )
        groups = view.group
        uniq, first, inverse, counts = np.unique(
            groups, return_index=True, return_inverse=True, return_counts=True
        )
        complete = (counts == self.group_size) & (uniq >= 0)
        if not complete.any():
            return np.empty(0, dtype=np.int64)
        # Oldest complete groups first (by the position of their first ready member).
        order = np.argsort(first[complete], kind="stable")
        take = np.flatnonzero(complete)[order][: n // self.group_size]
        chosen = np.zeros(uniq.size, dtype=bool)
        chosen[take] = True
        return np.flatnonzero(chosen[inverse])

    def __repr__(self) -> str:
        return f"GroupSampler(group_size={self.group_size})"


@final
class StalenessSampler(Sampler):
    """Only samples produced by a policy at most ``max_staleness`` versions old."""

    def __init__(self, max_staleness: int, inner: Sampler | None = None) -> None:
        self.max_staleness = int_in(
            max_staleness, 0, "StalenessSampler max_staleness must be an int >= 0"
        )
        self.inner = inner or FifoSampler()

    def quota(self, n: int) -> int:
        return self.inner.quota(n)

    def select(self, view: CandidateView, n: int) -> np.ndarray:
        fresh = np.flatnonzero(view.version >= view.current_version - self.max_staleness)
        if fresh.size == 0:
            return fresh.astype(np.int64)
        return fresh[self.inner.select(view.subset(fresh), n)]

    def __repr__(self) -> str:
        return f"StalenessSampler(max_staleness={self.max_staleness}, inner={self.inner!r})"


@final
class BalancedSampler(Sampler):
    """Token-balanced micro-batches for ``dp_size`` data-parallel ranks.

    A claim by any rank selects ``n * dp_size`` samples with ``inner`` and splits them into
    ``dp_size`` parts of ``n`` samples with near-equal token totals; the controller hands
    rank ``r`` part ``r`` and reserves the other parts for their ranks.
    """

    def __init__(self, dp_size: int, inner: Sampler | None = None) -> None:
        self.dp_size = int_in(dp_size, 1, "BalancedSampler dp_size must be a positive int")
        self.inner = inner or FifoSampler()

    def window(self, n: int) -> int | None:
        return self.inner.window(n * self.dp_size)

    def quota(self, n: int) -> int:
        """Per rank."""
        return self.inner.quota(n * self.dp_size) // self.dp_size

    def select(self, view: CandidateView, n: int) -> np.ndarray:
        return self.inner.select(view, n * self.dp_size)

    @property
    def keeps_groups(self) -> bool:
        """Whole GRPO groups go to one rank when the inner sampler selects whole groups."""
        inner = self.inner
        while isinstance(inner, StalenessSampler):
            inner = inner.inner
        return isinstance(inner, GroupSampler)

    def split(self, tokens: np.ndarray, groups: np.ndarray | None = None) -> list[np.ndarray]:
        """Partition positions ``0..len(tokens)`` into ``dp_size`` balanced parts.

        Snake order over units sorted by tokens, descending: ranks 0..R-1 then R-1..0, so
        every rank gets the same number of units and the heaviest are spread evenly. A unit
        is a sample, or a whole group when :attr:`keeps_groups` and ``groups`` is given.
        Fully vectorised.
        """
        r = self.dp_size
        if groups is not None and self.keeps_groups:
            uniq, unit_of = np.unique(groups, return_inverse=True)
            weight = np.bincount(unit_of, weights=tokens, minlength=uniq.size)
        else:
            unit_of, weight = np.arange(tokens.size), tokens
        order = np.argsort(-weight, kind="stable")
        lap, within = np.divmod(np.arange(order.size), r)
        rank_of_unit = np.empty(order.size, dtype=np.int64)
        rank_of_unit[order] = np.where(lap % 2 == 0, within, r - 1 - within)
        rank = rank_of_unit[unit_of]
        return [np.flatnonzero(rank == k) for k in range(r)]

    def __repr__(self) -> str:
        return f"BalancedSampler(dp_size={self.dp_size}, inner={self.inner!r})"
