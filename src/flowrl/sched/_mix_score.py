"""A fluid estimate of a mode layout's objective, for many layouts at once.

The planner's mode-mix search (:func:`flowrl.sched.solver.solve_relaxed`) ranks the
layouts it could move to by this estimate and gives only the best few the (much dearer)
assignment of requests. For a layout (a mode per node, ``-1`` off):

- *throughput*: the nodes share the whole work as a fluid, each from the end of its
  switch: ``sum_n max(0, T - sw_n) / W_n = 1`` with ``W_n`` the node's time to do all the
  requests alone (``work[m_n] @ count``), solved by water-filling;
- *latency* (tail problems only): every bucket with requests runs somewhere, at the least
  on the node where its lone latency ends first (``sw_n + lat[m_n, b]``);
- plus the objective's switch term and the migration the layout needs at the least (what
  each node holds beyond its fair share of the fluid split, the solver's migration floor).

Layouts over the GPU budget, with a node in a mode it cannot run, or whose KV capacity
cannot hold the requests score ``inf``. The estimate is a ranking device, not a bound:
the fluid split ignores which node suits which bucket and the co-runners' cost.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from flowrl.sched.problem import PlanProblem

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


def fluid_scores(p: PlanProblem, modes: I64) -> F64:
    """The estimate (module docstring) for each row of ``modes`` (layouts x nodes)."""
    modes = np.atleast_2d(np.asarray(modes, dtype=np.int64))
    k, n = modes.shape
    on = modes >= 0
    mm = np.maximum(modes, 0)
    nodes = np.arange(n)[None, :]
    sw = np.where(on, p.switch[nodes, mm], 0.0)
    alone = np.where(on, (p.work @ p.count)[mm], np.inf)
    inv = np.where(on, 1.0 / np.maximum(alone, 1e-12), 0.0)
    # water-filling: nodes join in order of their switch end; T for the first j joined
    order = np.argsort(np.where(on, sw, np.inf), axis=1, kind="stable")
    s_sw = np.take_along_axis(sw, order, axis=1)
    s_inv = np.take_along_axis(inv, order, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = (1.0 + np.cumsum(s_sw * s_inv, axis=1)) / np.cumsum(s_inv, axis=1)
    s_on = np.take_along_axis(on, order, axis=1)
    nxt = np.where(
        np.append(s_on[:, 1:], np.zeros((k, 1), bool), axis=1),
        np.append(s_sw[:, 1:], np.zeros((k, 1)), axis=1),
        np.inf,
    )
    ok = s_on & (lam <= nxt + 1e-12)
    first = np.argmax(ok, axis=1)
    thr = lam[np.arange(k), first]
    span = np.where(ok.any(axis=1), thr, np.inf)
    if p.lat.any():  # min over nodes of sw + lat = min over modes of (their least sw) + lat
        first_up = np.full((k, len(p.modes)), np.inf)
        rows = np.broadcast_to(np.arange(k)[:, None], (k, n))
        np.minimum.at(first_up, (rows[on], modes[on]), sw[on])
        lone = (first_up[:, :, None] + p.lat[None, :, p.count > 0]).min(axis=1)
        span = np.maximum(span, lone.max(axis=1, initial=0.0))
    # the migration floor: what a node holds beyond its share of the fluid split
    total = float(p.count.sum())
    share = total * inv / np.maximum(inv.sum(axis=1, keepdims=True), 1e-12)
    held = p.holdings.sum(axis=1).astype(np.float64)
    per = (p.holdings @ p.mig) / np.maximum(held, 1.0)
    floor = p.mig_weight * (per[None, :] * np.maximum(held[None, :] - share, 0.0)).sum(axis=1)
    gpus = np.where(on, p.mode_gpus[mm], 0).sum(axis=1)
    kv_room = np.where(on, p.kv_limit * p.cap[mm], 0.0).sum(axis=1)
    bad = (gpus > p.gpu_budget) | (on & ~p.allowed[nodes, mm]).any(axis=1)
    bad |= kv_room + 1e-6 < float(p.kv @ p.count)
    score = span + p.switch_weight * sw.sum(axis=1) + floor
    return np.where(bad | ~on.any(axis=1), np.inf, score)
