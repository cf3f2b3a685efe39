"""What a recipe shows while it runs: progress bars and log lines, both on stderr.

Log lines go through :mod:`logging` (logger ``flowrl.recipes``); the command line sends
them to stderr with :func:`log_to_stderr`, written through ``tqdm.write`` so that they
do not tear a progress bar, and stdout keeps only the JSON summary.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tqdm import tqdm

__all__ = ["bar", "format_step", "log", "log_to_stderr", "quarter_logger"]

log = logging.getLogger("flowrl.recipes")


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def log_to_stderr(level: int = logging.INFO) -> Iterator[None]:
    """Within the block, show the recipes' log lines (``level`` and above) on stderr."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def bar(total: int, desc: str, *, enabled: bool, unit: str = "step") -> tqdm[Any]:
    """A progress bar on stderr; a no-op object when not ``enabled`` or when stderr is not
    a terminal (a redirected stderr would fill with hundreds of ``\\r`` frames)."""
    shown = enabled and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=not shown, file=sys.stderr)


def quarter_logger(total: int, desc: str) -> Callable[[], None]:
    """A per-step callback that logs ``desc: N/total`` at each quarter of ``total``: the
    progress a bar would show, as a few lines where no bar is drawn."""
    marks = {max(1, round(total * q / 4)) for q in (1, 2, 3, 4)}
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if done in marks:
            log.info("%s: %d/%d", desc, done, total)

    return step


def format_step(m: Mapping[str, Any], steps: int) -> str:
    """One log line for a training step's metrics."""
    width = len(str(steps))
    return (
        f"step {m['step'] + 1:>{width}}/{steps}  reward {m['reward']:.3f}  "
        f"kl {m['kl_ref']:.4f}  loss {m['loss']:+.4f}  lag {m['lag_mean']:.2f} "
        f"(max {m['lag_max']})  {m['samples_per_s']:.1f} samples/s  "
        f"waited {m['wait_s']:.2f}s"
    )
