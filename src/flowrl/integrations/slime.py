"""flowrl inside slime: ``Sample`` rows, a hub-backed ``DataSource`` and a rollout function.

slime is not on PyPI and is never imported: everything here is duck-typed on slime's
``slime.utils.types.Sample`` dataclass (pass the class as ``sample_type``). A sample's
fields map to hub columns; ``group_index`` is the hub group (GRPO group) and ``index``
a column:

=====================  ==========================  ==========================
Sample field           hub column                  written by
=====================  ==========================  ==========================
index                  int64 scalar                the feeder
prompt                 object (str or messages)    the feeder
tokens                 ragged int64                feeder, then rollout stage
label, metadata        object                      the feeder
response               string                      rollout stage
response_length        int64 scalar                rollout stage
reward                 object (float, dict, None)  reward stage
loss_mask,             object (list or None)       rollout stage
rollout_log_probs
weight_versions        object (list[str])          rollout stage
status                 string (``Status`` value)   rollout stage
=====================  ==========================  ==========================

* :class:`HubDataSource` — slime's ``DataSource`` (``get_samples``/``add_samples``/
  ``save``/``load``/``__len__``) over prompts put in a hub with :func:`put_prompts`.
* :func:`rollout_function` — ``generate_rollout(args, rollout_id, data_source,
  evaluation=False)`` for ``--rollout-function-path``: feeds one step of prompt groups to
  the hub and drains ``args.rollout_batch_size`` *completed* groups, oldest first; groups
  still generating are carried over to the next call. Returns ``list[list[Sample]]``
  (slime's ``call_rollout_fn`` wraps it in ``RolloutFnTrainOutput``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from flowrl._client.base import HubClient
from flowrl._client.batch import Batch
from flowrl._controller.samplers import GroupSampler
from flowrl._schema.columns import Column
from flowrl.errors import ConfigError, EndOfStream, Timeout

__all__ = [
    "FEED_FIELDS",
    "PROMPT_COLUMNS",
    "RESULT_FIELDS",
    "HubDataSource",
    "put_prompts",
    "put_samples",
    "rollout_function",
    "sample_columns",
    "samples_from_batch",
]

FEED_FIELDS = ("index", "prompt", "tokens", "label", "metadata")
RESULT_FIELDS = (
    "response",
    "response_length",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "weight_versions",
    "status",
)
_KINDS: dict[str, Callable[[str], Column]] = {
    "index": lambda n: Column.scalar(n, "int64"),
    "tokens": lambda n: Column.ragged(n, "int64"),
    "response": Column.string,
    "response_length": lambda n: Column.scalar(n, "int64"),
    "status": Column.string,
}
#: The columns of a prompt hub (:class:`HubDataSource`): one row per prompt.
PROMPT_COLUMNS = (Column.object("prompt"), Column.object("label"), Column.object("metadata"))


def sample_columns() -> list[Column]:
    """The hub columns of slime ``Sample`` rows (module docstring)."""
    return [_KINDS.get(name, Column.object)(name) for name in (*FEED_FIELDS, *RESULT_FIELDS)]


def put_samples(
    hub: HubClient, groups: Sequence[Sequence[Any]], fields: Sequence[str] = FEED_FIELDS
) -> np.ndarray:
    """Put groups of ``Sample`` objects (``fields`` of each); returns the hub indices.

    Every sample of a group must carry the same ``group_index`` (slime sets it)."""
    rows = [s for group in groups for s in group]
    ids = np.array([_group_index(group) for group in groups for _ in group], dtype=np.int64)
    data = {name: [_field(s, name) for s in rows] for name in fields}
    if "tokens" in data:
        data["tokens"] = [np.asarray(t, dtype=np.int64) for t in data["tokens"]]
    if "status" in data:
        data["status"] = [getattr(v, "value", v) for v in data["status"]]
    return hub.put(data, groups=ids)


def samples_from_batch(batch: Batch, sample_type: type) -> list[list[Any]]:
    """The ``Sample`` objects of a batch, grouped by hub group in order of first appearance."""
    status_type = getattr(sample_type, "Status", None)
    names = {f.name for f in dataclasses.fields(sample_type)}
    by_group: dict[int, list[Any]] = {}
    columns = {name: batch[name] for name in batch.columns if name in names}
    for i, group in enumerate(batch.meta.groups.tolist()):
        values = {name: _value(col, i) for name, col in columns.items()}
        if "tokens" in values:
            values["tokens"] = [int(t) for t in values["tokens"]]
        if status_type is not None and isinstance(values.get("status"), str):
            values["status"] = status_type(values["status"])
        by_group.setdefault(group, []).append(sample_type(group_index=group, **values))
    return list(by_group.values())


def put_prompts(hub: HubClient, prompts: Sequence[Any]) -> np.ndarray:
    """Put dataset prompts (objects with ``prompt``, ``label``, ``metadata``) into a hub
    declared with :data:`PROMPT_COLUMNS`, one row each, for a :class:`HubDataSource`."""
    data = {c.name: [_field(p, c.name) for p in prompts] for c in PROMPT_COLUMNS}
    return hub.put(data)


class HubDataSource:
    """slime's ``DataSource`` over a prompt hub (:data:`PROMPT_COLUMNS`).

    ``get_samples(k)`` returns ``k`` groups of ``n_samples_per_prompt`` fresh ``Sample``
    objects: groups given back with ``add_samples`` (aborted partial rollouts) first, then
    prompts claimed from the hub (each acked once handed out). ``save``/``load`` write the
    counters and the given-back groups as msgpack under ``save_dir``.
    """

    def __init__(
        self,
        hub: HubClient,
        *,
        sample_type: type,
        n_samples_per_prompt: int,
        task: str = "slime_data_source",
        save_dir: str | Path | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(n_samples_per_prompt, int) or n_samples_per_prompt < 1:
            raise ConfigError(
                f"HubDataSource n_samples_per_prompt must be a positive int, got "
                f"{n_samples_per_prompt!r}"
            )
        self.hub = hub
        self.sample_type = sample_type
        self.n_samples_per_prompt = n_samples_per_prompt
        self.task = task
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.timeout = timeout
        self.buffer: list[list[Any]] = []
        self.sample_index = self.group_index = 0
        hub.register_task(task, [c.name for c in PROMPT_COLUMNS])

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        out = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        want = num_samples - len(out)
        if want:
            meta = self.hub.claim(self.task, want, timeout=self.timeout)
            rows = self.hub.get(meta)
            for i in range(len(rows)):
                fields = {c.name: rows[c.name][i] for c in PROMPT_COLUMNS}
                out.append(self._group(fields))
            self.hub.ack(meta)
        return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        for group in samples:
            if len(group) != self.n_samples_per_prompt:
                raise ConfigError(
                    f"HubDataSource.add_samples(): a group must hold n_samples_per_prompt="
                    f"{self.n_samples_per_prompt} samples, got {len(group)}"
                )
        self.buffer.extend(list(g) for g in samples)

    def save(self, rollout_id: int) -> None:
        if self.save_dir is None:
            return
        path = self.save_dir / f"flowrl_data_source_{rollout_id}.msgpack"
        state = {
            "sample_index": self.sample_index,
            "group_index": self.group_index,
            "buffer": [[_as_dict(s) for s in g] for g in self.buffer],
        }
        self.save_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.msgpack.encode(state))

    def load(self, rollout_id: int | None = None) -> None:
        if self.save_dir is None or rollout_id is None:
            return
        path = self.save_dir / f"flowrl_data_source_{rollout_id}.msgpack"
        if not path.exists():
            return
        state = msgspec.msgpack.decode(path.read_bytes())
        self.sample_index = state["sample_index"]
        self.group_index = state["group_index"]
        status_type = getattr(self.sample_type, "Status", None)
        self.buffer = [
            [self.sample_type(**_with_status(d, status_type)) for d in g] for g in state["buffer"]
        ]

    def __len__(self) -> int:
        """Groups available now: given back plus prompts ready in the hub."""
        return len(self.buffer) + self.hub.statistics().tasks[self.task].ready

    def _group(self, fields: dict[str, Any]) -> list[Any]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(
                self.sample_type(group_index=self.group_index, index=self.sample_index, **fields)
            )
            self.sample_index += 1
        self.group_index += 1
        return group


def rollout_function(
    hub: HubClient,
    *,
    sample_type: type,
    task: str = "slime_rollout",
    tokenize: Callable[[Any], Sequence[int]] | None = None,
    timeout: float | None = None,
) -> Callable[..., list[list[Any]]]:
    """A ``generate_rollout(args, rollout_id, data_source, evaluation=False)`` for slime's
    ``--rollout-function-path`` (assign it to a module-level name).

    Each call feeds ``args.rollout_batch_size`` prompt groups from ``data_source`` into
    ``hub`` (declared with :func:`sample_columns`; ``tokenize(prompt)`` fills ``tokens``
    where the data source left them empty) and returns ``args.rollout_batch_size``
    completed groups of ``args.n_samples_per_prompt`` — every :data:`RESULT_FIELDS`
    column written — oldest first. Unfinished groups stay for the next call.
    """
    columns = [c.name for c in sample_columns()]
    hub.register_task(task, columns)

    def generate_rollout(
        args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
    ) -> list[list[Any]]:
        if evaluation:
            raise ConfigError(
                "flowrl's slime rollout function serves training rollouts only; set "
                "--eval-function-path to slime's own eval rollout"
            )
        n_groups = int(args.rollout_batch_size)
        size = int(args.n_samples_per_prompt)
        groups = data_source.get_samples(n_groups)
        if tokenize is not None:
            for group in groups:
                for s in group:
                    if not s.tokens:
                        s.tokens = list(tokenize(s.prompt))
        put_samples(hub, groups)
        meta = _claim_groups(hub, task, n_groups * size, size, timeout)
        out = samples_from_batch(hub.get(meta), sample_type)
        hub.ack(meta)
        return out

    return generate_rollout


def _claim_groups(hub: HubClient, task: str, n: int, size: int, timeout: float | None) -> Any:
    try:
        meta = hub.claim(task, n, sampler=GroupSampler(size), timeout=timeout)
    except Timeout:
        raise Timeout(
            f"slime rollout function waited {timeout}s for {n // size} completed groups in "
            f"task {task!r}; are the hub's rollout and reward stages running?"
        ) from None
    if len(meta) < n:
        hub.release(meta)
        raise EndOfStream(
            f"slime rollout function: the hub's stream ended with {len(meta)} samples of "
            f"completed groups, fewer than the {n} a rollout step needs"
        )
    return meta


def _group_index(group: Sequence[Any]) -> int:
    ids: set[Any] = {getattr(s, "group_index", None) for s in group}
    if len(ids) != 1 or None in ids:
        raise ConfigError(
            f"put_samples(): every sample of a group needs the same group_index, got {ids}; "
            "slime's data source sets it (or set sample.group_index yourself)"
        )
    return int(ids.pop())


def _field(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise ConfigError(
            f"expected a slime Sample-like object with a {name!r} attribute, got "
            f"{type(obj).__name__}"
        ) from None


def _value(column: Any, i: int) -> Any:
    value = column[i]
    return value.item() if isinstance(value, np.generic) else value


def _as_dict(sample: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(sample):
        value = getattr(sample, f.name)
        if isinstance(value, (int, float, str, bool, list, dict, type(None))):
            out[f.name] = value
        elif hasattr(value, "value"):  # Sample.Status
            out[f.name] = value.value
    return out


def _with_status(d: dict[str, Any], status_type: Any) -> dict[str, Any]:
    if status_type is not None and isinstance(d.get("status"), str):
        d = {**d, "status": status_type(d["status"])}
    return d
