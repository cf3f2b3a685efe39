"""``flowrl run grpo``'s command line, kept free of heavy imports.

The options are parsed, and a bad one refused, before torch and the job's modules load
(seconds on a busy machine), so ``--help`` and argument errors answer at once. Ctrl-C
ends the run with one line saying how to resume it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from flowrl.errors import ConfigError, Timeout
from flowrl.recipes.cli import config_errors, parse_config
from flowrl.recipes.grpo_config import ENGINES, MODELS, PLACEMENTS, TASKS, TRAINERS, GRPOConfig
from flowrl.recipes.progress import log_to_stderr

__all__ = ["DESCRIPTION", "PROG", "check_out_folder", "main"]

PROG = "flowrl run grpo"
DESCRIPTION = """\
GRPO on CPU, streaming through the embedded hub: a small transformer learns multi-digit
addition (a supervised warm-up, then RL steps; see docs/grpo.md).

Each run writes OUT/<timestamp>/: config.json, metrics.jsonl (one line per step),
checkpoints/ and timeline.png. Progress bars (on a terminal) and log lines go to stderr;
the last line of stdout is the JSON summary. Ctrl-C stops the run; --resume continues it.

examples:
  flowrl run grpo                                   one-step-off streaming (max staleness 1)
  flowrl run grpo --max-staleness 0                 synchronous, reproducible for a --seed
  flowrl run grpo --task chain --placement disaggregated --engine torch
                                                    long-tailed answers, rollout on its own cores
  flowrl run grpo --resume runs/grpo/20260101-120000 --steps 400   continue a run"""

_CHOICES = {
    "engine": ENGINES,
    "trainer": TRAINERS,
    "model": MODELS,
    "task": TASKS,
    "placement": PLACEMENTS,
}
INTERRUPTED_STATUS = 130  # what a shell reports for a process ended by SIGINT


def _read_saved(run_dir: Path) -> dict[str, Any]:
    from flowrl.recipes.checkpoint import read_config  # torch: only when resuming

    return read_config(run_dir)


def check_out_folder(out: str) -> None:
    """Refuse an ``--out`` that cannot hold run folders, before anything runs: a file, a
    path under a file, or a folder this user cannot create or write in."""
    path = Path(out)
    existing = path
    while not existing.exists():  # the nearest ancestor that exists decides
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise ConfigError(f"--out {out!r}: expected a folder, but the path {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        verb = "write in" if existing == path else f"create folders in {existing}"
        raise ConfigError(f"--out {out!r}: this user cannot {verb}; pick another --out")


def main(argv: list[str] | None = None) -> int:
    """``flowrl run grpo [options]``: run the job, print the JSON summary on stdout."""
    cfg, resume = parse_config(
        GRPOConfig,
        argv,
        prog=PROG,
        description=DESCRIPTION,
        read_saved=_read_saved,
        choices=_CHOICES,
    )
    with config_errors(PROG):
        if resume is None:
            check_out_folder(cfg.out)
    from flowrl.recipes.grpo_arith import Interrupted, run  # torch and the job

    try:
        with log_to_stderr(), config_errors(PROG):
            summary = run(cfg, resume=resume)
    except Timeout as exc:  # the run stalled: the message is the diagnosis
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"{PROG}: {exc.advice()}", file=sys.stderr)
        return INTERRUPTED_STATUS
    print(json.dumps(summary))
    return 0
