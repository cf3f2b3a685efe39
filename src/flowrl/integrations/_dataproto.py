"""flowrl ``Batch`` <-> verl ``DataProto``, lossless both ways.

Where each column goes (``to_dataproto``):

==================================  ===================================================
flowrl column                       DataProto
==================================  ===================================================
scalar / tensor                     ``batch[name]``: ``(n,)`` / ``(n, *shape)`` tensor
prompt + response (ragged),         verl's worker layout in ``batch``: ``prompts``
``layout="padded"``                 (left-padded), ``responses`` (right-padded),
                                    ``input_ids``, ``attention_mask``, ``position_ids``,
                                    ``response_mask``
other ragged with the response's    ``batch[name]``: ``(n, R)``, right-padded with 0
lengths, ``layout="padded"``        (per-token log-probs, versions, a ``response_mask``)
every ragged, ``layout="nopad"``    ``batch[name]``: a jagged nested tensor (no padding)
other ragged, string, object        ``non_tensor_batch[name]``: numpy object array
GRPO group                          ``non_tensor_batch["uid"]`` (str) + ``flowrl_group``
sample index, version, unit,        ``batch["flowrl_index"]``, ``flowrl_version``,
tokens                              ``flowrl_unit``, ``flowrl_tokens`` (int64)
task, lease, schema, layout         ``meta_info["flowrl"]`` (plain lists and strs)
==================================  ===================================================

The per-sample fields travel as tensors, so they survive verl's ``chunk``, ``concat``,
``reorder`` and ``union``; ``from_dataproto`` rebuilds a :class:`~flowrl.Batch` (with a
``BatchMeta`` whose lease can be acked) from any DataProto made this way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from flowrl._client.batch import Batch
from flowrl._controller.meta import BatchMeta
from flowrl._schema.columns import Column
from flowrl._schema.encode import encode
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import ConfigError, SchemaError
from flowrl.integrations._verl_compat import require_verl

__all__ = ["Layout", "from_dataproto", "to_dataproto"]

Layout = Literal["padded", "nopad"]
META_KEY = "flowrl"
# DataProto tensor flowrl_<key> <- BatchMeta attribute
_PER_SAMPLE = {
    "index": "indices",
    "version": "versions",
    "group": "groups",
    "unit": "units",
    "tokens": "tokens",
}
_VERL_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "uid",
)


def to_dataproto(
    batch: Batch,
    *,
    layout: Layout = "padded",
    prompt: str = "prompt_ids",
    response: str = "response_ids",
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    meta_info: Mapping[str, Any] | None = None,
) -> Any:
    """The samples of ``batch`` as a verl ``DataProto`` (module docstring for the layout).

    ``prompt``/``response``: the ragged token columns that make verl's padded sequence
    tensors (used only when both are in the batch). ``prompt_length``/``response_length``:
    pad to these widths (verl pads to ``data.max_prompt_length`` and
    ``rollout.response_length``) instead of the batch's longest. ``meta_info``: batch-level
    values verl reads there (``temperature``, ``global_steps``, ...).
    """
    require_verl()
    import torch
    from verl import DataProto

    if not isinstance(batch, Batch):
        raise ConfigError(f"to_dataproto() expects a flowrl.Batch, got {type(batch).__name__}")
    if layout not in ("padded", "nopad"):
        raise ConfigError(f"to_dataproto() layout must be 'padded' or 'nopad', got {layout!r}")
    columns = {name: batch.column(name) for name in batch.columns}
    _check_names(columns)
    tensors: dict[str, Any] = {}
    objects: dict[str, np.ndarray] = {}
    token_columns: list[str] = []
    seq = layout == "padded" and prompt in columns and response in columns
    if seq:
        _check_token_ids(columns[prompt], columns[response])
        tensors.update(
            _verl_sequences(
                batch.ragged(prompt),
                batch.ragged(response),
                pad_token_id,
                prompt_length,
                response_length,
            )
        )
    response_lengths = batch.ragged(response).lengths if seq else None
    for name, column in columns.items():
        if seq and name in (prompt, response):
            continue
        if column.kind in ("scalar", "tensor"):
            tensors[name] = torch.from_numpy(np.array(batch.numpy(name)))
        elif column.kind == "ragged" and layout == "nopad":
            tensors[name] = _nested(batch.ragged(name))
        elif column.kind == "ragged" and _aligned(batch.ragged(name), response_lengths):
            width = tensors["responses"].shape[1]
            values, _ = batch.ragged(name).padded(0, width, False)
            tensors[name] = torch.from_numpy(np.array(values))
            token_columns.append(name)
        elif column.kind == "ragged":
            objects[name] = _object_array([np.array(s) for s in batch.ragged(name)])
        else:
            objects[name] = _object_array(batch[name])
    meta = batch.meta
    for key, attribute in _PER_SAMPLE.items():
        values = getattr(meta, attribute)
        tensors[f"flowrl_{key}"] = torch.from_numpy(values.astype(np.int64))
    objects["uid"] = _object_array([str(g) for g in meta.groups])
    info = dict(meta_info or {})
    info[META_KEY] = {
        "task": meta.task,
        "lease": meta.lease,
        "deadline": meta.deadline,
        "dp_rank": meta.dp_rank,
        "layout": layout,
        "sequence": [prompt, response] if seq else [],
        "token_columns": token_columns,
        "columns": [[c.name, c.kind, c.dtype, list(c.shape)] for c in columns.values()],
    }
    dp = DataProto.from_dict(tensors=tensors, non_tensors=objects, meta_info=info)
    dp.check_consistency()
    return dp


def from_dataproto(dp: Any) -> Batch:
    """The :class:`~flowrl.Batch` a ``to_dataproto`` result (or a chunk, concat or reorder
    of some) holds; its ``meta`` acks the original lease (``hub.ack(batch.meta)``)."""
    info = _flowrl_info(dp)
    n = len(dp)
    columns = {
        name: Column(name, kind, dtype, tuple(shape))
        for name, kind, dtype, shape in info["columns"]
    }
    prompt, response = info["sequence"] or (None, None)
    _check_keys(dp, info)
    if prompt is not None:
        ragged = _unpad_sequences(dp, n)
    where = "from_dataproto()"
    arrays = {}
    for name, column in columns.items():
        if name in (prompt, response):
            r = ragged[0 if name == prompt else 1]
            values: Any = RaggedArray(r.values.astype(column.np_dtype), r.cu_seqlens)
        elif column.kind in ("scalar", "tensor"):
            values = dp.batch[name].numpy()
        elif column.kind == "ragged" and info["layout"] == "nopad":
            values = _unnest(dp.batch[name])
        elif name in info["token_columns"]:
            values = RaggedArray.from_padded(dp.batch[name].numpy(), ragged[1].lengths)
        else:
            values = list(dp.non_tensor_batch[name])
        arrays[name] = encode(column, values, n, where).array
    fields = {f: dp.batch[f"flowrl_{f}"].numpy().astype(np.int64) for f in _PER_SAMPLE}
    meta = BatchMeta(
        task=info["task"],
        lease=info["lease"],
        columns=tuple(columns),
        indices=fields["index"],
        units=fields["unit"].astype(np.int16),
        tokens=fields["tokens"],
        versions=fields["version"],
        groups=fields["group"],
        nbytes=sum(a.nbytes for a in arrays.values()),
        deadline=info["deadline"],
        dp_rank=info["dp_rank"],
    )
    return Batch(meta, arrays, columns)


# -- padded sequences ---------------------------------------------------------------------
def _verl_sequences(
    prompts: RaggedArray,
    responses: RaggedArray,
    pad: int,
    prompt_length: int | None,
    response_length: int | None,
) -> dict[str, Any]:
    import torch

    p_len = _width(prompts, prompt_length, "prompt_length")
    r_len = _width(responses, response_length, "response_length")
    p_ids, p_mask = prompts.padded(pad, p_len, True)
    r_ids, r_mask = responses.padded(pad, r_len, False)
    p_ids_t = torch.from_numpy(np.array(p_ids, dtype=np.int64))
    r_ids_t = torch.from_numpy(np.array(r_ids, dtype=np.int64))
    attention = torch.from_numpy(np.concatenate([p_mask, r_mask], axis=1).astype(np.int64))
    return {
        "prompts": p_ids_t,
        "responses": r_ids_t,
        "input_ids": torch.cat([p_ids_t, r_ids_t], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clip(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": torch.from_numpy(r_mask.astype(np.int64)),
    }


def _unpad_sequences(dp: Any, n: int) -> tuple[RaggedArray, RaggedArray]:
    prompts = dp.batch["prompts"].numpy()
    responses = dp.batch["responses"].numpy()
    attention = dp.batch["attention_mask"].numpy()
    width = prompts.shape[1]
    p_lengths = attention[:, :width].sum(axis=1)
    r_lengths = attention[:, width:].sum(axis=1)
    p_seqs = [prompts[i, width - p_lengths[i] :] for i in range(n)]
    return RaggedArray.from_list(p_seqs, np.int64), RaggedArray.from_padded(responses, r_lengths)


def _width(r: RaggedArray, want: int | None, name: str) -> int:
    longest = int(r.lengths.max()) if len(r) else 0
    if want is None:
        return longest
    if want < longest:
        raise SchemaError(
            f"to_dataproto() {name}={want} is shorter than the longest sequence ({longest}); "
            f"raise {name} or leave it None to pad to the longest"
        )
    return want


def _aligned(r: RaggedArray, response_lengths: np.ndarray | None) -> bool:
    return response_lengths is not None and np.array_equal(r.lengths, response_lengths)


# -- no padding ---------------------------------------------------------------------------
def _nested(r: RaggedArray) -> Any:
    import torch

    return torch.nested.nested_tensor_from_jagged(
        torch.from_numpy(np.array(r.values)), offsets=torch.from_numpy(np.array(r.cu_seqlens))
    )


def _unnest(t: Any) -> RaggedArray:
    offsets = t.offsets().numpy()
    start, end = int(offsets[0]), int(offsets[-1])  # a view of a chunk may not start at 0
    return RaggedArray(t.values().numpy()[start:end], offsets - start)


# -- checks and helpers -------------------------------------------------------------------
def _check_names(columns: Mapping[str, Column]) -> None:
    clash = [n for n in columns if n.startswith("flowrl_") or n in _VERL_KEYS]
    if clash:
        raise SchemaError(
            f"to_dataproto(): columns {clash} collide with the DataProto keys flowrl writes "
            f"({', '.join(_VERL_KEYS)} and flowrl_*); rename them in the hub's schema"
        )


def _check_token_ids(*columns: Column) -> None:
    for c in columns:
        if c.kind != "ragged" or c.np_dtype.kind not in "iu":
            raise SchemaError(
                f"to_dataproto(): column {c.name!r} must hold ragged integer token ids, got "
                f"{c.describe()}; pass prompt=/response= naming the token columns"
            )


def _check_keys(dp: Any, info: Mapping[str, Any]) -> None:
    """Every key from_dataproto reads is there (verl code may have popped some)."""
    tensors = set(dp.batch.keys()) if dp.batch is not None else set()
    want = {f"flowrl_{f}" for f in _PER_SAMPLE}
    if info["sequence"]:
        want |= {"prompts", "responses", "attention_mask", *info["token_columns"]}
    objects: set[str] = set()
    for name, kind, _, _ in info["columns"]:
        if name in info["sequence"] or name in info["token_columns"]:
            continue
        dense = kind in ("scalar", "tensor") or (kind == "ragged" and info["layout"] == "nopad")
        (want if dense else objects).add(name)
    missing = sorted((want - tensors) | (objects - set(dp.non_tensor_batch)))
    if missing:
        raise SchemaError(
            f"from_dataproto(): the DataProto lacks {missing}, which to_dataproto wrote; "
            "pop keys from a copy (dp.select(...)) rather than from the batch you convert back"
        )


def _object_array(values: Any) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _flowrl_info(dp: Any) -> dict[str, Any]:
    info = getattr(dp, "meta_info", None)
    if not isinstance(info, Mapping) or META_KEY not in info:
        raise ConfigError(
            "from_dataproto() expects a DataProto made by flowrl's to_dataproto (its "
            f"meta_info has no {META_KEY!r} entry), got {type(dp).__name__}"
        )
    return info[META_KEY]
