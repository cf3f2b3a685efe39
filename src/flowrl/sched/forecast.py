"""Online forecast of a step's response-length distribution, for the requests still running.

Two layers (OrchestrRL §4.1 asks for "an online prediction of the step-level output-length
distribution ... using an ARIMA model", updated as requests complete):

1. **Across steps** — after each step we record quantiles of log response length at fixed
   probabilities (``QUANTILE_PROBS``). Each quantile's series (the last ``history`` steps) is
   forecast one step ahead by an ARIMA with drift (a random walk with drift, ``(0,1,0)``,
   until 8 steps; ``(1,1,0)`` from 8, fitted by least squares, see :func:`_arima_next`). The
   forecast quantiles, joined piecewise-linearly in normal-score space and
   extrapolated linearly beyond the outer ones, give the *prior* survival function of the
   next step. Before any step is seen the prior is ``lognormal(median, sigma)`` from config.
2. **Within a step** — finished responses are exact observations, running requests are
   right-censored at their generated length. The Kaplan-Meier estimator gives the survival
   function wherever at least ``min_at_risk`` requests were at risk; beyond that the prior's
   tail is spliced on (scaled to be continuous). So the estimate follows the realised
   lengths as the wave completes, and the prior only speaks about lengths nobody reached.

From the survival function ``S`` the forecaster answers what the planner needs: the expected
remaining length ``E[L - g | L > g]`` of a request that generated ``g`` tokens, and the
expected number of remaining requests per 256-token remaining-length bucket.
:func:`bucket_relative_error` scores that histogram against the realised one:
``sum_b |pred_b - actual_b| / sum_b actual_b`` (0 is perfect, 2 is disjoint).

Invariants (asserted by tests): ``S`` is non-increasing on the grid, ``S(0) = 1``,
``S(max_len) = 0``; expected remaining lengths are >= 0 and never exceed ``max_len - g``;
predicted bucket counts sum to the number of requests asked about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

import msgspec
import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr, ndtri

from flowrl.errors import ConfigError
from flowrl.events import Event, Put

__all__ = [
    "QUANTILE_PROBS",
    "ForecastConfig",
    "ForecastStatistics",
    "LengthDistribution",
    "LengthForecaster",
    "RemainingEstimate",
    "bucket_relative_error",
    "kaplan_meier",
]

F64 = NDArray[np.float64]
QUANTILE_PROBS: tuple[float, ...] = (0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.97, 0.995)


@final
class ForecastConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Prior before any step is seen, the length grid, and the censoring threshold."""

    median: float = 1500.0
    sigma: float = 1.0
    max_len: int = 32768
    grid_step: int = 32
    bucket: int = 256
    min_at_risk: int = 30
    history: int = 64
    response_column: str = "response"

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma <= 0:
            raise ConfigError("ForecastConfig median and sigma must be > 0")
        if self.grid_step < 1 or self.bucket < self.grid_step or self.max_len < self.bucket:
            raise ConfigError("ForecastConfig needs 1 <= grid_step <= bucket <= max_len")
        if self.min_at_risk < 1:
            raise ConfigError(f"min_at_risk must be >= 1, got {self.min_at_risk}")
        if self.history < 2:
            raise ConfigError(f"history must be >= 2 steps, got {self.history}")


@final
class ForecastStatistics(msgspec.Struct, frozen=True):
    steps_seen: int
    finished_this_step: int
    forecast_median: float
    last_bucket_error: float


@final
@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Survival function ``surv[j] = P(L > grid[j])`` on an even grid ``0..max_len``."""

    grid: F64
    surv: F64

    def _s(self, x: ArrayLike) -> F64:
        return np.interp(np.asarray(x, dtype=np.float64), self.grid, self.surv)

    def _tail_integrals(self, g: F64) -> tuple[F64, F64, F64]:
        """``(S(g), int_g^M S(x) dx, int_g^M x S(x) dx)`` by the trapezoid rule on the grid."""
        x, s = self.grid, self.surv
        step = x[1] - x[0]
        seg0 = 0.5 * (s[1:] + s[:-1]) * step
        seg1 = 0.5 * (x[1:] * s[1:] + x[:-1] * s[:-1]) * step
        i0 = np.concatenate([np.cumsum(seg0[::-1])[::-1], [0.0]])  # integrals from grid[j]
        i1 = np.concatenate([np.cumsum(seg1[::-1])[::-1], [0.0]])
        j = np.minimum((g // step).astype(np.int64), len(x) - 1)
        frac = g - x[j]
        s_g = self._s(g)
        return (
            s_g,
            i0[j] - 0.5 * (s[j] + s_g) * frac,
            i1[j] - 0.5 * (x[j] * s[j] + g * s_g) * frac,
        )

    def remaining_moments(self, generated: ArrayLike) -> tuple[F64, F64]:
        """``(E[R], E[R^2])`` of the remaining length ``R = L - g`` given ``L > g``.

        ``E[R^2] = 2 * int_g^M (x - g) S(x) dx / S(g)``. The second moment is what a
        request's KV reads cost: decoding ``R`` more tokens from context ``c`` reads
        ``R*c + R^2/2`` KV tokens, so the mean length alone underestimates the work of a
        heavy-tailed remainder (Jensen). Both are 0 where ``g`` is at the cap.
        """
        g = np.clip(np.asarray(generated, dtype=np.float64), 0, self.grid[-1])
        s_g, i0, i1 = self._tail_integrals(g)
        alive = s_g > 1e-12
        inv = 1.0 / np.maximum(s_g, 1e-12)
        cap = self.grid[-1] - g
        mean = np.clip(np.where(alive, i0 * inv, 0.0), 0.0, cap)
        second = np.clip(np.where(alive, 2.0 * (i1 - g * i0) * inv, 0.0), mean**2, cap**2)
        return mean, second

    def expected_remaining(self, generated: ArrayLike) -> F64:
        """``E[L - g | L > g]`` per request (0 where ``g`` is at the cap)."""
        return self.remaining_moments(generated)[0]

    def bucket_probs(self, generated: ArrayLike, bucket: int) -> F64:
        """``P(L - g in [k*bucket, (k+1)*bucket) | L > g)``, shape ``(len(g), n_buckets)``."""
        g = np.asarray(generated, dtype=np.float64)
        nb = int(np.ceil(self.grid[-1] / bucket))
        edges = g[:, None] + bucket * np.arange(nb + 1)[None, :]
        s = self._s(np.minimum(edges, self.grid[-1]))
        s[:, -1] = 0.0
        s0 = np.maximum(s[:, :1], 1e-12)
        p = (s[:, :-1] - s[:, 1:]) / s0
        dead = s[:, 0] <= 1e-12  # at the cap: finishes within the first bucket
        p[dead] = 0.0
        p[dead, 0] = 1.0
        return np.clip(p, 0.0, 1.0)

    def remaining_quantile(self, generated: ArrayLike, p: ArrayLike) -> F64:
        """``x`` with ``P(L - g <= x | L > g) = p`` per request (vectorised)."""
        g = np.clip(np.asarray(generated, dtype=np.float64), 0, self.grid[-1])
        target = (1.0 - np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)) * self._s(g)
        x = np.interp(target, self.surv[::-1], self.grid[::-1])
        return np.clip(x - g, 0.0, self.grid[-1] - g)

    def quantile(self, p: float) -> float:
        return float(np.interp(1.0 - p, self.surv[::-1], self.grid[::-1]))


@final
@dataclass(frozen=True, slots=True)
class RemainingEstimate:
    """Per pending request: ``E[R]``, ``E[R^2]`` and a tail (expected-maximum) length.

    What :func:`~flowrl.sched.planner.plan` reads. :meth:`known` builds one from exact
    remaining lengths (a trace, a test, an oracle).
    """

    mean: F64
    second: F64
    tail: F64

    def __post_init__(self) -> None:
        for f in ("mean", "second", "tail"):
            object.__setattr__(self, f, np.asarray(getattr(self, f), dtype=np.float64))
        if not self.mean.shape == self.second.shape == self.tail.shape or self.mean.ndim != 1:
            raise ConfigError(
                f"RemainingEstimate needs three 1-d arrays of one length, got shapes "
                f"{self.mean.shape}, {self.second.shape}, {self.tail.shape}"
            )

    def __len__(self) -> int:
        return len(self.mean)

    @staticmethod
    def known(remaining: ArrayLike) -> RemainingEstimate:
        r = np.maximum(np.asarray(remaining, dtype=np.float64), 0.0)
        return RemainingEstimate(r, r**2, r)


def kaplan_meier(events: ArrayLike, censored: ArrayLike, grid: ArrayLike) -> tuple[F64, F64]:
    """Kaplan-Meier survival ``P(L > x)`` and the number at risk, both evaluated on ``grid``.

    ``events`` are exact lengths of finished responses, ``censored`` the generated lengths of
    running ones (known only to exceed that).
    """
    ev = np.sort(np.asarray(events, dtype=np.float64))
    ce = np.sort(np.asarray(censored, dtype=np.float64))
    x = np.asarray(grid, dtype=np.float64)
    if len(ev) == 0:
        at_risk = len(ce) - np.searchsorted(ce, x, side="left")
        return np.ones_like(x), at_risk.astype(np.float64)
    times, d = np.unique(ev, return_counts=True)
    n = (len(ev) - np.searchsorted(ev, times, side="left")) + (
        len(ce) - np.searchsorted(ce, times, side="left")
    )
    with np.errstate(divide="ignore"):  # d == n: survival drops to exactly 0
        log_s = np.cumsum(np.log1p(-d / n))
    idx = np.searchsorted(times, x, side="right") - 1
    surv = np.where(idx >= 0, np.exp(log_s[np.maximum(idx, 0)]), 1.0)
    at_risk = (len(ev) - np.searchsorted(ev, x, side="right")) + (
        len(ce) - np.searchsorted(ce, x, side="right")
    )
    return surv, at_risk.astype(np.float64)


def bucket_relative_error(predicted: ArrayLike, actual: ArrayLike) -> float:
    """``sum |pred - actual| / sum actual`` over buckets (histograms of equal length)."""
    p = np.asarray(predicted, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if p.shape != a.shape:
        raise ConfigError(f"histograms differ in shape: {p.shape} vs {a.shape}")
    tot = a.sum()
    return float(np.abs(p - a).sum() / tot) if tot > 0 else 0.0


def _arima_next(series: F64) -> float:
    """One-step-ahead forecast of a short per-step statistic series, ARIMA(p, 1, 0) + drift.

    Below 8 points it is a random walk with drift (``p = 0``: last value + mean change);
    from 8 on, ``p = 1``: ``d_t = c + phi * d_{t-1} + e_t`` on the first differences, fitted
    by conditional least squares (``numpy.linalg.lstsq``: the estimator of statsmodels'
    ``OLS``, ``AutoReg`` and ``ARIMA((1, 1, 0), trend="t").fit(method="css")``, in a few
    microseconds where a state-space likelihood fit takes a few hundred milliseconds).
    """
    n = len(series)
    if n == 1:
        return float(series[0])
    diff = np.diff(series)
    if n < 8 or np.ptp(diff[:-1]) < 1e-9:  # too short, or a constant regressor: no AR fit
        return float(series[-1] + diff.mean())
    design = np.column_stack([np.ones(len(diff) - 1), diff[:-1]])
    (c, phi), *_ = np.linalg.lstsq(design, diff[1:], rcond=None)
    return float(series[-1] + c + phi * diff[-1])


@dataclass(slots=True)
class _OpenStep:
    total: int = 0
    lengths: list[int] = field(default_factory=list)


@final
class LengthForecaster:
    """Observer of the hub's events that maintains the remaining-length distribution.

    Feed it events (:meth:`observe`) or call :meth:`begin_step` / :meth:`record` /
    :meth:`end_step` directly. ``Put`` events with ``new=True`` add prompts to the step their
    ``partition`` names (a new partition is the current step); ``Put`` events carrying
    ``response_column`` report finished responses, their ``tokens`` being the response
    lengths. A response counts for the step its prompt came in, so steps that overlap
    (asynchronous RL) keep their own lengths; a step closes — its quantiles join the history
    and the prior is refitted — once it is no longer current and all its prompts have
    responded.
    """

    def __init__(self, config: ForecastConfig | None = None) -> None:
        self.config = config or ForecastConfig()
        c = self.config
        self._grid = np.arange(0.0, c.max_len + c.grid_step, c.grid_step)
        self._grid[-1] = float(c.max_len)
        self._history: list[F64] = []
        self._partition: str | None = None
        self._finished: list[int] = []
        self._open: dict[str, _OpenStep] = {}
        self._step_of: dict[int, str] = {}
        self._prior = self._make_prior(self._initial_quantiles())
        self._last_error = float("nan")

    # -- event interface -------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        if not isinstance(event, Put):
            return
        if event.new:
            p = event.partition
            if p != self._partition:
                previous, self._partition = self._partition, p
                self._finished = []
                if previous is not None:
                    self._maybe_close(previous)
            step = self._open.setdefault(p, _OpenStep())
            step.total += len(event.indices)
            self._step_of.update(dict.fromkeys(event.indices, p))
        if self.config.response_column in event.columns and event.tokens:
            for i, tok in zip(event.indices, event.tokens, strict=True):
                q = self._step_of.pop(i, None)
                if q is None or q == self._partition:
                    self._finished.append(int(tok))  # the current step's, for Kaplan-Meier
                if q is not None:
                    self._open[q].lengths.append(int(tok))
                    self._maybe_close(q)

    def _maybe_close(self, p: str) -> None:
        step = self._open.get(p)
        if step is not None and p != self._partition and len(step.lengths) >= step.total:
            del self._open[p]
            self._add_history(step.lengths)

    def begin_step(self) -> None:
        """Start a step by hand (without events)."""
        self._finished = []

    def record(self, lengths: ArrayLike) -> None:
        self._finished.extend(int(v) for v in np.asarray(lengths).ravel())

    def end_step(self) -> None:
        """Close a step started by hand: add its quantiles to the history, refit the prior."""
        self._add_history(self._finished)
        self._finished = []

    def _add_history(self, lengths: list[int]) -> None:
        if lengths:
            logs = np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
            self._history.append(np.quantile(logs, QUANTILE_PROBS))
            self._prior = self._make_prior(self._forecast_quantiles())

    # -- queries -----------------------------------------------------------------------------
    def prior(self) -> LengthDistribution:
        return LengthDistribution(self._grid, self._prior)

    def distribution(self, running_generated: ArrayLike = ()) -> LengthDistribution:
        """Current estimate: KM on this step's finished/censored lengths + the prior's tail."""
        c = self.config
        if not self._finished:
            return self.prior()
        km, at_risk = kaplan_meier(self._finished, running_generated, self._grid)
        ok = np.nonzero(at_risk >= c.min_at_risk)[0]
        cut = int(ok[-1]) if len(ok) else 0
        prior = self._prior
        surv = km.copy()
        if cut < len(self._grid) - 1:
            scale = km[cut] / max(prior[cut], 1e-12)
            surv[cut:] = np.minimum(km[cut], prior[cut:] * scale)
        surv[-1] = 0.0
        surv = np.minimum.accumulate(np.clip(surv, 0.0, 1.0))
        return LengthDistribution(self._grid, surv)

    def expected_remaining(self, generated: ArrayLike, running_generated: ArrayLike = ()) -> F64:
        return self.distribution(running_generated).expected_remaining(generated)

    def estimates(
        self, generated: ArrayLike, running_generated: ArrayLike = (), *, bucket: int | None = None
    ) -> RemainingEstimate:
        """Remaining-length estimate per request, as the planner takes it.

        ``mean`` and ``second`` are ``E[R]`` and ``E[R^2]``
        (:meth:`LengthDistribution.remaining_moments`); ``tail`` is the expected maximum of
        the requests sharing a bucket of expected remaining length: the conditional quantile
        at ``1 - 1/(n_b + 1)``, ``n_b`` being the bucket's size. It feeds the planner's
        latency bound, since a makespan is set by the longest of many heavy-tailed
        requests, not by their mean.
        """
        g = np.asarray(generated, dtype=np.float64)
        dist = self.distribution(running_generated)
        mean, second = dist.remaining_moments(g)
        b = np.ceil(np.maximum(mean, 1.0) / (bucket or self.config.bucket)).astype(np.int64)
        _, inv, cnt = np.unique(b, return_inverse=True, return_counts=True)
        tail = dist.remaining_quantile(g, 1.0 - 1.0 / (cnt[inv] + 1.0))
        return RemainingEstimate(mean, second, np.maximum(tail, mean))

    def predicted_buckets(self, generated: ArrayLike, running_generated: ArrayLike = ()) -> F64:
        """Expected number of the given requests per remaining-length bucket."""
        g = np.asarray(generated, dtype=np.float64)
        dist = self.distribution(running_generated)
        uniq, inv = np.unique(g, return_inverse=True)
        probs = dist.bucket_probs(uniq, self.config.bucket)
        return np.bincount(inv, minlength=len(uniq)) @ probs

    def score(self, generated: ArrayLike, true_remaining: ArrayLike) -> float:
        """Bucket-level relative error of the forecast for requests with known outcome."""
        g = np.asarray(generated, dtype=np.float64)
        pred = self.predicted_buckets(g, g)
        nb = len(pred)
        bins = np.minimum(np.asarray(true_remaining) // self.config.bucket, nb - 1).astype(int)
        actual = np.bincount(bins, minlength=nb)
        self._last_error = bucket_relative_error(pred, actual)
        return self._last_error

    def statistics(self) -> ForecastStatistics:
        return ForecastStatistics(
            steps_seen=len(self._history),
            finished_this_step=len(self._finished),
            forecast_median=self.prior().quantile(0.5),
            last_bucket_error=self._last_error,
        )

    # -- prior construction ----------------------------------------------------------------------
    def _initial_quantiles(self) -> F64:
        z = ndtri(np.asarray(QUANTILE_PROBS))
        return np.log(self.config.median) + self.config.sigma * z

    def _forecast_quantiles(self) -> F64:
        hist = np.vstack(self._history[-self.config.history :])
        q = np.array([_arima_next(hist[:, j]) for j in range(hist.shape[1])])
        return np.maximum.accumulate(q)  # quantiles must stay ordered

    def _make_prior(self, log_q: F64) -> F64:
        z = ndtri(np.asarray(QUANTILE_PROBS))
        lq = np.maximum.accumulate(np.asarray(log_q, dtype=np.float64) + 1e-9 * np.arange(len(z)))
        x = np.log(np.maximum(self._grid, 1.0))
        lo_slope = (z[1] - z[0]) / max(lq[1] - lq[0], 1e-6)
        hi_slope = (z[-1] - z[-2]) / max(lq[-1] - lq[-2], 1e-6)
        zx = np.interp(x, lq, z)
        zx = np.where(x < lq[0], z[0] + (x - lq[0]) * lo_slope, zx)
        zx = np.where(x > lq[-1], z[-1] + (x - lq[-1]) * hi_slope, zx)
        surv = 1.0 - ndtr(zx)
        surv[0] = 1.0
        surv[-1] = 0.0
        return np.minimum.accumulate(surv)
