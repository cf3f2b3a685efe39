"""flowrl inside slime: ``Sample`` rows, a hub-backed ``DataSource`` and a rollout function.

slime is not on PyPI and is never imported: everything here is duck-typed on slime's
``slime.utils.types.Sample`` dataclass (pass the class as ``sample_type``). Every field but
``group_index`` (the hub group) maps to hub columns, losslessly (``_slime_fields``):
numeric sequences as ragged columns (with a ``<field>_layout`` column that brings back
``None``, tensors and nested lists), numbers and strings as scalar and string columns, the
rest as msgpack objects. :data:`FEED_FIELDS` are put when a group is fed,
:data:`RESULT_FIELDS` by the hub's rollout and reward stages (:func:`sample_data`).

* :class:`HubDataSource` — slime's ``DataSource`` (``get_samples``/``add_samples``/
  ``save``/``load``/``__len__``) over prompts put in a hub with :func:`put_prompts`.
* :func:`rollout_function` — ``generate_rollout(args, rollout_id, data_source,
  evaluation=False)`` for ``--rollout-function-path``: feeds one step of prompt groups to
  the hub and drains ``args.rollout_batch_size`` *completed* groups, oldest first; groups
  still generating are carried over to the next call. Returns ``list[list[Sample]]``
  (slime's ``call_rollout_fn`` wraps it in ``RolloutFnTrainOutput``).
"""

from __future__ import annotations

import copy
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
from flowrl.errors import ConfigError, EndOfStream, SchemaError, Timeout
from flowrl.integrations._slime_fields import (
    FEED_FIELDS,
    LAYOUT_SUFFIX,
    RESULT_FIELDS,
    SAMPLE_FIELDS,
    TENSOR_FIELDS,
    decode_field,
    encode_field,
    field_columns,
    field_of_object,
    object_of_field,
)

__all__ = [
    "FEED_FIELDS",
    "PROMPT_COLUMNS",
    "PROMPT_FIELDS",
    "RESULT_FIELDS",
    "SAMPLE_FIELDS",
    "HubDataSource",
    "check_sample_type",
    "put_prompts",
    "put_samples",
    "rollout_function",
    "sample_columns",
    "sample_data",
    "samples_from_batch",
]

#: The fields slime's dataset sets on a prompt ``Sample``: a prompt hub's columns.
PROMPT_FIELDS = ("prompt", "label", "metadata", "multimodal_inputs")
#: The columns of a prompt hub (:class:`HubDataSource`): one row per prompt.
PROMPT_COLUMNS = tuple(Column.object(name) for name in PROMPT_FIELDS)


def sample_columns() -> list[Column]:
    """The hub columns of slime ``Sample`` rows: every field but ``group_index``."""
    return [column for name in SAMPLE_FIELDS for column in field_columns(name)]


def check_sample_type(sample_type: type) -> None:
    """Refuse a ``Sample`` class with fields flowrl does not carry (a newer slime)."""
    names = {f.name for f in dataclasses.fields(sample_type)} - {"group_index"}
    unknown = sorted(names - set(SAMPLE_FIELDS))
    if unknown:
        raise ConfigError(
            f"{sample_type.__qualname__} has fields flowrl's slime bridge does not carry: "
            f"{unknown}; they would come back reset. Upgrade flowrl, or drop the fields"
        )


def sample_data(samples: Sequence[Any], fields: Sequence[str] = RESULT_FIELDS) -> dict[str, Any]:
    """``fields`` of ``samples`` as the data of their hub columns, for ``hub.put``.

    A rollout stage writes its results with
    ``hub.put(sample_data(samples), indices=meta)``."""
    unknown = [name for name in fields if name not in SAMPLE_FIELDS]
    if unknown:
        raise ConfigError(f"sample_data(): {unknown} are not slime Sample fields kept in a hub")
    data: dict[str, Any] = {}
    for name in fields:
        data.update(encode_field(name, [_field(s, name) for s in samples]))
    return data


def put_samples(
    hub: HubClient, groups: Sequence[Sequence[Any]], fields: Sequence[str] = FEED_FIELDS
) -> np.ndarray:
    """Put groups of ``Sample`` objects (``fields`` of each); returns the hub indices.

    Every sample of a group must carry the same ``group_index`` (slime sets it)."""
    ids = np.array([_group_index(group) for group in groups for _ in group], dtype=np.int64)
    return hub.put(sample_data([s for group in groups for s in group], fields), groups=ids)


def samples_from_batch(batch: Batch, sample_type: type) -> list[list[Any]]:
    """The ``Sample`` objects of a batch, grouped by hub group in order of first appearance.

    Fields whose columns are not in the batch keep ``sample_type``'s defaults."""
    check_sample_type(sample_type)
    fields = {f.name: f for f in dataclasses.fields(sample_type) if f.name in batch.columns}
    for name in TENSOR_FIELDS.keys() & fields.keys():
        if name + LAYOUT_SUFFIX not in batch.columns:
            raise SchemaError(
                f"samples_from_batch(): column {name!r} needs {name + LAYOUT_SUFFIX!r} in the "
                "same batch (it says None, tensor or list); get both columns"
            )
    columns = {name: batch[name] for name in batch.columns}
    by_group: dict[int, list[Any]] = {}
    for i, group in enumerate(batch.meta.groups.tolist()):
        values = {name: decode_field(name, columns, i, f) for name, f in fields.items()}
        by_group.setdefault(group, []).append(sample_type(group_index=group, **values))
    return list(by_group.values())


def put_prompts(hub: HubClient, prompts: Sequence[Any]) -> np.ndarray:
    """Put dataset prompts (slime's prompt ``Sample`` objects: :data:`PROMPT_FIELDS`) into
    a hub declared with :data:`PROMPT_COLUMNS`, one row each, for a :class:`HubDataSource`."""
    return hub.put(sample_data(prompts, PROMPT_FIELDS))


class HubDataSource:
    """slime's ``DataSource`` over a prompt hub (:data:`PROMPT_COLUMNS`).

    ``get_samples(k)`` returns ``k`` groups of ``n_samples_per_prompt`` fresh ``Sample``
    objects: groups given back with ``add_samples`` (aborted partial rollouts) first, then
    prompts claimed from the hub (each acked once handed out), one deep copy of the prompt
    per sample as slime's own data source makes. ``save``/``load`` write the counters and
    the given-back groups (every field, losslessly) as msgpack under ``save_dir``.
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
        check_sample_type(sample_type)
        self.hub = hub
        self.sample_type = sample_type
        self._fields = {f.name: f for f in dataclasses.fields(sample_type)}
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
            columns = {name: rows[name] for name in PROMPT_FIELDS}
            for i in range(len(rows)):
                fields = {n: decode_field(n, columns, i, self._fields[n]) for n in PROMPT_FIELDS}
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
            "buffer": [[_record(s) for s in g] for g in self.buffer],
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
        self.buffer = [[self._from_record(d) for d in g] for g in state["buffer"]]

    def __len__(self) -> int:
        """Groups available now: given back plus prompts ready in the hub."""
        return len(self.buffer) + self.hub.statistics().tasks[self.task].ready

    def _group(self, fields: dict[str, Any]) -> list[Any]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(
                self.sample_type(
                    group_index=self.group_index, index=self.sample_index, **copy.deepcopy(fields)
                )
            )
            self.sample_index += 1
        self.group_index += 1
        return group

    def _from_record(self, record: dict[str, Any]) -> Any:
        return self.sample_type(
            **{name: field_of_object(v, self._fields[name]) for name, v in record.items()}
        )


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
    check_sample_type(sample_type)
    hub.register_task(task, [c.name for c in sample_columns()])

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


def _record(sample: Any) -> dict[str, Any]:
    """Every field of ``sample`` as msgpack-encodable data (:func:`object_of_field`)."""
    return {
        f.name: object_of_field(f.name, getattr(sample, f.name)) for f in dataclasses.fields(sample)
    }
