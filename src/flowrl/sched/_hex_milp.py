"""The joint allocation MILP (AReaL-Hex eq. 2 with length classes, plus the split) and the
breakpoint search that makes it exact without a bilinear term.

For a target step ``S`` everything is linear: a training plan ``k`` is allowed when its step
``T_k <= S``, a (replica, class) pair when its straggler ``tail + fixed_s <= S``. Between
two consecutive *breakpoints* (the values of ``T_k`` and ``tail + fixed_s``) the allowed
sets are constant, and the best generation time is the inverse of the best rate ``r`` of::

    max r  s.t.  sum_psi q[psi,w]          = B_w * r        every class w
                 sum_w seconds[psi,w] q[psi,w] <= y_psi      every configuration psi
                 sum_k gpus[k,t] z_k + sum_psi gpus[psi,t] y_psi <= n_t   every GPU type t
                 sum_k z_k = 1,  z binary,  y integer,  q >= 0

(``q`` is rollouts per second, so ``x = q / r`` are the rollouts of each class given to each
configuration, and ``1 / r`` the makespan: the paper's ``x * len <= y * h * Theta`` divided
by ``Theta``.) On interval ``i`` the best step is ``F_i = max(b_i, 1/r_i + fixed_s)``; ``r_i``
never decreases with ``i``, so the first interval whose ``1/r_i + fixed_s`` falls below the
next breakpoint holds the optimum. The search bisects the intervals with the LP relaxation
first (its rate is an upper bound, so its first interval cannot lie after the optimum's),
then gallops up from there with integer probes and bisects the last stride: about
``log2(breakpoints)`` LPs and one to three MILPs. Only training plans whose GPU vector is
minimal among the allowed ones enter a probe (``_Frontier``). Exact up to HiGHS's
relative gap (1e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import sparse

from flowrl.errors import ConfigError
from flowrl.sched import _highs

__all__ = ["Instance", "Solution", "solve"]

MIP_GAP = 1e-6


@final
@dataclass(frozen=True, slots=True)
class Instance:
    """``seconds``/``tail`` (configs x classes), ``config_gpus`` (configs x types),
    ``demand`` (rollouts per class), ``train_gpus``/``train_s`` (candidates), ``counts`` per
    type, ``fixed_s`` added to generation (reward, weight sync)."""

    seconds: NDArray[np.float64]
    tail: NDArray[np.float64]
    config_gpus: NDArray[np.int64]
    demand: NDArray[np.float64]
    train_gpus: NDArray[np.int64]
    train_s: NDArray[np.float64]
    counts: NDArray[np.int64]
    fixed_s: float


@final
@dataclass(frozen=True, slots=True)
class Solution:
    step_s: float
    train: int  # index into the instance's candidates
    replicas: NDArray[np.int64]
    assigned: NDArray[np.float64]  # rollouts, configs x classes
    makespan: float  # generation alone, tails included
    probes: int


@final
class _Frontier:
    """Training plans on the grid of their GPU counts (each type's distinct counts in order),
    where "another plan uses no more GPUs of any type" is a prefix along every axis: a
    cumulative minimum answers it for all plans at once. Rows must be distinct."""

    def __init__(self, gpus: NDArray[np.int64], step_s: NDArray[np.float64]) -> None:
        cols = [np.unique(c, return_inverse=True) for c in gpus.T]
        self.at = tuple(inv.reshape(-1) for _, inv in cols)
        self.shape = tuple(len(u) for u, _ in cols)
        self.step_s = step_s

    def _below(self, values: NDArray[np.float64]) -> NDArray[np.float64]:
        """Per plan, the least value among the plans using no more of any type (itself
        excluded): the minimum over axes of the prefix minimum one step down that axis."""
        grid = np.full(self.shape, np.inf)
        grid[self.at] = values
        for ax in range(grid.ndim):
            np.minimum.accumulate(grid, axis=ax, out=grid)
        out = np.full(self.shape, np.inf)
        for ax in range(grid.ndim):
            lower = [slice(None)] * grid.ndim
            upper = [slice(None)] * grid.ndim
            lower[ax], upper[ax] = slice(1, None), slice(None, -1)
            np.minimum(out[tuple(lower)], grid[tuple(upper)], out=out[tuple(lower)])
        return out[self.at]

    def useful(self) -> NDArray[np.bool_]:
        """Plans no other plan beats on time with no more GPUs of any type."""
        return self._below(self.step_s) > self.step_s

    def minimal(self, level: float) -> NDArray[np.int64]:
        """Plans allowed at ``level`` whose GPU vector is minimal among the allowed: a plan
        using more GPUs than an allowed one never helps generation, so a probe keeps only
        these (a few dozen of the thousand splits at 256 GPUs)."""
        allowed = self.step_s <= level
        present = np.where(allowed, 0.0, np.inf)
        return np.flatnonzero(allowed & (self._below(present) > 0))


@final
@dataclass(frozen=True, slots=True)
class _Probe:
    rate: float
    train: int
    replicas: NDArray[np.int64]
    assigned: NDArray[np.float64]  # rollouts, configs x classes


def _probe(
    inst: Instance, frontier: _Frontier, level: float, *, relax: bool = False
) -> _Probe | None:
    """The best rate with the plans and pairs allowed at step ``level`` (None: none);
    ``relax``: of the LP relaxation (an upper bound on the rate)."""
    train = frontier.minimal(level)
    if not len(train):
        return None
    pairs = np.argwhere((inst.tail + inst.fixed_s <= level) & np.isfinite(inst.seconds))
    n_cfg, n_cls = inst.seconds.shape
    if len(np.unique(pairs[:, 1])) < n_cls:
        return None
    k, p, a = len(train), n_cfg, len(pairs)
    # columns: r | z (k) | y (p) | q (a)
    cz, cy, cq = 1, 1 + k, 1 + k + p
    n = cq + a
    ri: list[NDArray[np.int64]] = []
    ci: list[NDArray[np.int64]] = []
    val: list[NDArray[np.float64]] = []

    def add(r: NDArray[np.int64], c: NDArray[np.int64], v: ArrayLike) -> None:
        ri.append(np.asarray(r, dtype=np.int64))
        ci.append(np.asarray(c, dtype=np.int64))
        val.append(np.asarray(v, dtype=np.float64))

    row = 0
    # classes: sum_psi q - B_w r = 0
    add(row + pairs[:, 1], cq + np.arange(a), np.ones(a))
    add(row + np.arange(n_cls), np.zeros(n_cls, dtype=np.int64), -inst.demand)
    lo = [np.zeros(n_cls)]
    hi = [np.zeros(n_cls)]
    row += n_cls
    # configs: sum_w seconds q - y <= 0
    add(row + pairs[:, 0], cq + np.arange(a), inst.seconds[pairs[:, 0], pairs[:, 1]])
    add(row + np.arange(p), cy + np.arange(p), -np.ones(p))
    lo.append(np.full(p, -np.inf))
    hi.append(np.zeros(p))
    row += p
    # GPU types
    types = inst.counts.shape[0]
    tz, kz = np.nonzero(inst.train_gpus[train].T)
    add(row + tz, cz + kz, inst.train_gpus[train].T[tz, kz])
    ty, py = np.nonzero(inst.config_gpus.T)
    add(row + ty, cy + py, inst.config_gpus.T[ty, py])
    lo.append(np.full(types, -np.inf))
    hi.append(inst.counts.astype(np.float64))
    row += types
    # one training plan
    add(np.full(k, row), cz + np.arange(k), np.ones(k))
    lo.append(np.ones(1))
    hi.append(np.ones(1))
    row += 1
    a_mat = sparse.csr_matrix(
        (np.concatenate(val), (np.concatenate(ri), np.concatenate(ci))), shape=(row, n)
    )
    cost = np.zeros(n)
    cost[0] = -1.0
    col_lo = np.zeros(n)
    col_hi = np.full(n, np.inf)
    col_hi[cz : cz + k] = 1.0
    col_hi[cy : cy + p] = np.min(
        np.where(inst.config_gpus > 0, inst.counts // np.maximum(inst.config_gpus, 1), np.inf),
        axis=1,
    )
    integer = np.zeros(n, dtype=bool)
    integer[cz:cq] = not relax
    res = _highs.solve(
        cost,
        a_mat,
        np.concatenate(lo),
        np.concatenate(hi),
        col_lo,
        col_hi,
        integer=integer,
        mip_rel_gap=MIP_GAP,
    )
    if not res.ok or res.x[0] <= 0:
        return None
    rate = float(res.x[0])
    assigned = np.zeros((n_cfg, n_cls))
    assigned[pairs[:, 0], pairs[:, 1]] = res.x[cq:] / rate
    return _Probe(
        rate=rate,
        train=int(train[int(np.argmax(res.x[cz:cy]))]),
        replicas=np.rint(res.x[cy:cq]).astype(np.int64),
        assigned=assigned,
    )


def solve(inst: Instance) -> Solution:
    """The minimum step of ``inst`` (see the module docstring)."""
    frontier = _Frontier(inst.train_gpus, inst.train_s)
    finite = np.isfinite(inst.tail) & np.isfinite(inst.seconds)
    useful = inst.train_s[frontier.useful()]
    levels = np.unique(np.concatenate([useful, inst.tail[finite] + inst.fixed_s]))
    nxt = np.append(levels[1:], math.inf)
    probes = 0

    def done(i: int, relax: bool) -> _Probe | None:
        nonlocal probes
        probes += 1
        got = _probe(inst, frontier, float(levels[i]), relax=relax)
        return got if got is not None and 1.0 / got.rate + inst.fixed_s <= nxt[i] else None

    # the relaxation's rate is an upper bound, so its first done interval is a lower bound
    lo, hi = 0, len(levels) - 1
    if not len(levels) or done(hi, relax=True) is None:
        raise ConfigError("no split gives both training and generation a plan that fits these GPUs")
    while lo < hi:
        mid = (lo + hi) // 2
        if done(mid, relax=True) is not None:
            hi = mid
        else:
            lo = mid + 1
    # integer probes: gallop up from the relaxation's interval, then bisect
    stride, fail = 1, lo - 1
    while (best := done(lo, relax=False)) is None:
        if lo == len(levels) - 1:
            raise ConfigError(
                "no split gives both training and generation a plan that fits these GPUs"
            )
        fail, lo = lo, min(lo + stride, len(levels) - 1)
        stride *= 2
    hi = lo
    lo = fail + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if (got := done(mid, relax=False)) is not None:
            hi, best = mid, got
        else:
            lo = mid + 1
    used = best.assigned > 1e-9 * inst.demand.sum()
    makespan = max(1.0 / best.rate, float(inst.tail[used].max(initial=0.0)))
    step = max(float(inst.train_s[best.train]), makespan + inst.fixed_s)
    return Solution(step, best.train, best.replicas, best.assigned, makespan, probes)
