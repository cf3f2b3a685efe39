"""Thin wrapper around highspy: solve ``min c@x s.t. lo <= A@x <= hi, lb <= x <= ub``.

Kept separate so the planner reads as a model, not as solver plumbing. highspy is imported
lazily (it is an optional dependency: the ``sched`` extra).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray
from scipy import sparse

from flowrl.errors import ConfigError

__all__ = ["LpResult", "solve"]


@final
@dataclass(frozen=True, slots=True)
class LpResult:
    ok: bool
    x: NDArray[np.float64]
    objective: float
    bound: float
    status: str


def solve(
    cost: NDArray[np.float64],
    a: sparse.spmatrix,
    row_lo: NDArray[np.float64],
    row_hi: NDArray[np.float64],
    col_lo: NDArray[np.float64],
    col_hi: NDArray[np.float64],
    *,
    integer: NDArray[np.bool_] | None = None,
    time_limit: float | None = None,
    iteration_limit: int | None = None,
    start: NDArray[np.float64] | None = None,
    mip_rel_gap: float = 1e-6,
) -> LpResult:
    """Solve with HiGHS; ``ok`` is True when a feasible point was found (optimal or not).

    ``threads=1`` and counted limits (``iteration_limit``) keep a solve deterministic;
    ``time_limit`` does not.
    """
    try:
        import highspy
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError(
            "the planner's MILP needs highspy; install the 'sched' extra (pip install highspy)"
        ) from exc
    csc = sparse.csc_matrix(a)
    _silence_banner(highspy)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    if time_limit is not None:
        h.setOptionValue("time_limit", max(float(time_limit), 1e-3))
    if iteration_limit is not None:  # a counted budget: the result does not depend on speed
        h.setOptionValue("simplex_iteration_limit", int(iteration_limit))
        h.setOptionValue("ipm_iteration_limit", int(iteration_limit))
        h.setOptionValue("solver", "simplex")
    lp = highspy.HighsLp()
    lp.num_col_ = csc.shape[1]
    lp.num_row_ = csc.shape[0]
    lp.col_cost_ = np.asarray(cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(col_lo, dtype=np.float64)
    lp.col_upper_ = np.asarray(col_hi, dtype=np.float64)
    lp.row_lower_ = np.asarray(row_lo, dtype=np.float64)
    lp.row_upper_ = np.asarray(row_hi, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = csc.indptr.astype(np.int32)
    lp.a_matrix_.index_ = csc.indices.astype(np.int32)
    lp.a_matrix_.value_ = csc.data.astype(np.float64)
    lp.a_matrix_.num_col_ = csc.shape[1]
    lp.a_matrix_.num_row_ = csc.shape[0]
    if integer is not None and integer.any():
        kinds = [
            highspy.HighsVarType.kInteger if f else highspy.HighsVarType.kContinuous
            for f in integer
        ]
        lp.integrality_ = kinds
        h.setOptionValue("mip_rel_gap", mip_rel_gap)
    h.passModel(lp)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(np.asarray(start, dtype=np.float64))
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    x = np.asarray(h.getSolution().col_value, dtype=np.float64)
    has_point = len(x) == csc.shape[1] and info.primal_solution_status == 2
    bound = float(getattr(info, "mip_dual_bound", float("nan")))
    if integer is None or not integer.any():
        bound = float(info.objective_function_value) if has_point else float("nan")
    obj = float(info.objective_function_value) if has_point else float("inf")
    return LpResult(ok=bool(has_point), x=x, objective=obj, bound=bound, status=status)


@functools.cache
def _silence_banner(highspy: object) -> None:
    """HiGHS prints its banner to stdout (fd 1, from C) when the first solver is built,
    before ``output_flag`` can be set; build that first one with fd 1 pointed at stderr, so
    the stdout of a caller (a benchmark's ``--json``) stays its own."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        highspy.Highs()  # type: ignore[attr-defined]
    finally:
        os.dup2(saved, 1)
        os.close(saved)
