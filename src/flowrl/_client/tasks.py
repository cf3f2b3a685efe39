"""The consuming tasks a hub is made with (``tasks=``), checked before anything is built."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flowrl._config import HubConfig
from flowrl._schema.columns import Column
from flowrl._schema.schema import Schema
from flowrl.errors import ConfigError

__all__ = ["checked_tasks"]


def checked_tasks(
    tasks: Any, columns: Iterable[Column], config: HubConfig
) -> dict[str, tuple[str, ...]]:
    """``tasks`` (None, or a mapping of task name to the columns it needs) with every
    name checked against ``columns`` as the hub will declare them; ConfigError or
    UnknownColumnError otherwise. Checked first, a bad task leaves nothing half-made."""
    if tasks is None:
        return {}
    if not isinstance(tasks, Mapping):
        raise ConfigError(
            f"tasks must map each task name to the columns it needs, got {type(tasks).__name__}"
        )
    cols = tuple(columns)
    infer = config.infer_columns if config.infer_columns is not None else not cols
    schema = Schema(cols, infer=infer)
    checked = {}
    for task, names in tasks.items():
        if not isinstance(task, str) or not task:
            raise ConfigError(f"tasks: a task name must be a non-empty str, got {task!r}")
        checked[task] = schema.check_names(names, f"tasks={{{task!r}: ...}}")
    return checked
