"""Metrics sinks, in the shape of verl's ``Tracking``: ``log(data, step)`` and ``finish()``.

::

    from flowrl.tracking import Tracking

    tracking = Tracking(["console", "tensorboard"], run_dir="runs/exp1", config={"lr": 2e-4})
    tracking.log({"reward": 0.41, "loss": 0.12, "busy": {"rollout": 0.9}}, step=0)
    tracking.finish()

Backends (``BACKENDS``; the optional ones are extras, loaded only when named):

* ``console``: one line per ``log`` on a logger (``flowrl.tracking`` unless told;
  ``every=N``: the steps divisible by N, and ``last``), ``key value`` pairs or the line
  ``format`` makes.
* ``jsonl``: ``RUN/metrics.jsonl``, one JSON object per step (``step`` included).
* ``tensorboard``: event files in ``RUN/tensorboard/`` (``pip install 'flowrl[tensorboard]'``).
* ``wandb``: a Weights & Biases run in ``RUN/`` (``pip install 'flowrl[wandb]'``);
  ``WANDB_MODE=offline`` writes it locally, for ``wandb sync`` later.

Nested dicts are flattened with ``/`` (``busy/rollout``), as TensorBoard and W&B group
them; TensorBoard and W&B receive only the numbers. Add a backend with
:func:`register_backend`. A sink is an observer of the run: one that raises is logged and
dropped (the run goes on); one that cannot start (a missing package) is refused at once
with :class:`~flowrl.errors.ConfigError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, final

from flowrl.errors import ConfigError

__all__ = [
    "BACKENDS",
    "ConsoleTracker",
    "JsonlTracker",
    "TensorBoardTracker",
    "Tracker",
    "Tracking",
    "WandbTracker",
    "flatten",
    "register_backend",
]

log = logging.getLogger("flowrl.tracking")


class Tracker(ABC):
    """One sink. ``log`` is called once per step with that step's metrics."""

    @abstractmethod
    def log(self, data: Mapping[str, Any], step: int) -> None: ...

    def finish(self) -> None:  # noqa: B027 - optional: most sinks flush in log
        """Flush and close; the tracker is not used afterwards."""


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"busy": {"rollout": 0.9}}`` -> ``{"busy/rollout": 0.9}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _numbers(data: Mapping[str, Any]) -> dict[str, float]:
    """The finite-or-not real numbers of ``data`` (bools and strings left out)."""
    return {
        k: float(v)
        for k, v in flatten(data).items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


@final
class ConsoleTracker(Tracker):
    """A log line per step (every ``every``-th), made by ``format`` or as ``key value``s."""

    def __init__(
        self,
        *,
        every: int = 1,
        last: int | None = None,
        format: Callable[[Mapping[str, Any], int], str] | None = None,
        logger: logging.Logger = log,
    ) -> None:
        if every < 0:
            raise ConfigError(f"ConsoleTracker(every={every}): expected an int >= 0 (0: never)")
        self.every = every
        self.last = last  # a step that is always shown (the run's last)
        self._format = format
        self._logger = logger

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if not self.every or (step % self.every and step != self.last):
            return
        if self._format is not None:
            line = self._format(data, step)
        else:
            pairs = (f"{k} {_short(v)}" for k, v in flatten(data).items())
            line = f"step {step}  " + "  ".join(pairs)
        self._logger.info("%s", line)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@final
class JsonlTracker(Tracker):
    """``path`` gets one JSON line per step: ``{"step": N, ...data}``, flushed at once.

    ``history``: lines to write first (a resumed run's steps so far).
    """

    def __init__(self, path: str | os.PathLike[str], *, history: Iterable[Mapping] = ()) -> None:
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "w")  # noqa: SIM115 - closed in finish
        for line in history:
            self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": step, **data} if "step" not in data else data) + "\n")
        self._file.flush()

    def write_line(self, line: Mapping[str, Any]) -> None:
        """A line that is not a step's (e.g. the run's summary)."""
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


@final
class TensorBoardTracker(Tracker):
    """Scalars in TensorBoard event files under ``log_dir`` (``tensorboard --logdir``)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "the tensorboard logger needs the tensorboard package: "
                "pip install 'flowrl[tensorboard]'"
            ) from exc
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for key, value in _numbers(data).items():
            if math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()


@final
class WandbTracker(Tracker):
    """A Weights & Biases run; its files go under ``dir`` (``WANDB_MODE=offline``: only
    there, to ``wandb sync`` later)."""

    def __init__(
        self,
        *,
        project: str = "flowrl",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        dir: str | os.PathLike[str] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "the wandb logger needs the wandb package: pip install 'flowrl[wandb]' "
                "(WANDB_MODE=offline runs it without a network)"
            ) from exc
        self._run = wandb.init(
            project=project,
            name=name,
            config=dict(config or {}),
            dir=None if dir is None else str(dir),
            reinit="create_new",
        )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._run.log(_numbers(data), step=step)

    def finish(self) -> None:
        self._run.finish()


# name -> factory(run_dir, config) of a sink
BackendFactory = Callable[[Path, Mapping[str, Any]], Tracker]
BACKENDS: dict[str, BackendFactory] = {
    "console": lambda run_dir, config: ConsoleTracker(),
    "jsonl": lambda run_dir, config: JsonlTracker(run_dir / "metrics.jsonl"),
    "tensorboard": lambda run_dir, config: TensorBoardTracker(run_dir / "tensorboard"),
    "wandb": lambda run_dir, config: WandbTracker(name=run_dir.name, config=config, dir=run_dir),
}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` usable in :class:`Tracking` (and ``--logger``): ``factory(run_dir,
    config)`` returns the :class:`Tracker`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"register_backend({name!r}): expected a name like 'mlflow'")
    if not callable(factory):
        raise ConfigError(
            f"register_backend({name!r}, {factory!r}): expected a callable "
            "factory(run_dir, config) -> Tracker"
        )
    BACKENDS[name] = factory


def parse_backends(spec: str | Iterable[str]) -> tuple[str, ...]:
    """``"console,tensorboard"`` (or a list) -> the names, checked against ``BACKENDS``."""
    names = tuple(n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not all(names):
        raise ConfigError(
            f"unknown logger backend(s) {unknown or ['']}; expected names from "
            f"{', '.join(sorted(BACKENDS))}, comma-separated (register_backend adds one)"
        )
    return names


@final
class Tracking(Tracker):
    """Every sink of ``backends`` (names of ``BACKENDS``, or :class:`Tracker` objects) at
    once; ``run_dir`` is created if missing."""

    def __init__(
        self,
        backends: str | Iterable[str | Tracker],
        *,
        run_dir: str | os.PathLike[str] = ".",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        items = backends.split(",") if isinstance(backends, str) else list(backends)
        self.trackers: dict[str, Tracker] = {}
        try:
            for item in items:
                if isinstance(item, Tracker):
                    self.trackers[type(item).__name__] = item
                else:
                    (name,) = parse_backends([item])
                    self.trackers[name] = BACKENDS[name](folder, config or {})
        except BaseException:
            self.finish()
            raise

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(data, step)
            except Exception:  # an observer fails soft: logged, then dropped
                log.exception("the %s logger failed at step %d and is dropped", name, step)
                self._drop(name)

    def finish(self) -> None:
        for name in list(self.trackers):
            self._drop(name)

    def _drop(self, name: str) -> None:
        tracker = self.trackers.pop(name)
        try:
            tracker.finish()
        except Exception:
            log.exception("the %s logger failed to finish", name)
