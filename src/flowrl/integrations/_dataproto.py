"""flowrl ``Batch`` <-> verl ``DataProto``, lossless both ways.

Where each column goes (``to_dataproto``):

==================================  ===================================================
flowrl column                       DataProto
==================================  ===================================================
scalar / tensor                     ``batch[name]``: ``(n,)`` / ``(n, *shape)`` tensor
prompt + response (ragged),         verl's worker layout in ``batch``: ``prompts``
``layout="padded"``                 (left-padded), ``responses`` (right-padded),
                                    ``input_ids``, ``attention_mask``, ``position_ids``,
                                    ``response_mask``; a column of one of these names
                                    (a multi-turn ``response_mask``) is written instead
other ragged with the response's    ``batch[name]``: ``(n, R)``, right-padded with 0
lengths, ``layout="padded"``        (per-token log-probs, versions, masks)
every ragged, ``layout="nopad"``    ``batch[name]``: a jagged nested tensor (no padding)
other ragged, string, object        ``non_tensor_batch[name]``: numpy object array
named in ``non_tensor=``            ``non_tensor_batch[name]``: numbers as a numpy
                                    array of their dtype, ragged as an object array
GRPO group                          ``non_tensor_batch["uid"]`` (str), unless a column
                                    is named ``uid``
the claim (per row)                 ``batch["flowrl:rows"]``, ``non_tensor_batch
                                    ["flowrl:task"]`` (``_dataproto_rows``)
schema and layout                   ``meta_info["flowrl:schema"]``: equal for batches of
                                    one schema, so verl's ``concat`` merges it
==================================  ===================================================

``from_dataproto`` takes any DataProto: the keys ``to_dataproto`` wrote come back as the
columns they were; every other key (a batch verl built, fields verl added) becomes the
column ``_dataproto_infer`` gives it, and verl's padded ``prompts``/``responses`` become
ragged token columns whose lengths come from ``attention_mask`` (``_dataproto_padded``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from flowrl._client.batch import Batch
from flowrl._schema.columns import Column
from flowrl._schema.encode import encode
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import ConfigError, SchemaError
from flowrl.integrations._dataproto_infer import host, infer_array, infer_tensor, unnest
from flowrl.integrations._dataproto_padded import (
    LAYOUT_KEYS,
    tensor_keys,
    unpad,
    verl_sequence_columns,
    verl_sequences,
)
from flowrl.integrations._dataproto_rows import ROWS_KEY, TASK_KEY, batch_meta, rows_of
from flowrl.integrations._verl_compat import require_verl

__all__ = ["Layout", "from_dataproto", "to_dataproto"]

Layout = Literal["padded", "nopad"]
META_KEY = "flowrl:schema"
_WHERE = "from_dataproto()"


def to_dataproto(
    batch: Batch,
    *,
    layout: Layout = "padded",
    prompt: str = "prompt_ids",
    response: str = "response_ids",
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    non_tensor: Sequence[str] = (),
    meta_info: Mapping[str, Any] | None = None,
) -> Any:
    """The samples of ``batch`` as a verl ``DataProto`` (module docstring for the layout).

    ``prompt``/``response``: the ragged token columns that make verl's padded sequence
    tensors (used only when both are in the batch). ``prompt_length``/``response_length``:
    pad to these widths (verl pads to ``data.max_prompt_length`` and
    ``rollout.response_length``) instead of the batch's longest. ``non_tensor``: columns to
    put in ``non_tensor_batch`` (numbers as numpy arrays of their dtype, as verl keeps
    ``__num_turns__``; ragged as object arrays). ``meta_info``: batch-level values verl
    reads there (``temperature``, ``global_steps``, ...).
    """
    require_verl()
    import torch
    from verl import DataProto

    if not isinstance(batch, Batch):
        raise ConfigError(f"to_dataproto() expects a flowrl.Batch, got {type(batch).__name__}")
    if layout not in ("padded", "nopad"):
        raise ConfigError(f"to_dataproto() layout must be 'padded' or 'nopad', got {layout!r}")
    columns = {name: batch.column(name) for name in batch.columns}
    apart = _check_non_tensor(non_tensor, columns)
    seq = layout == "padded" and prompt in columns and response in columns
    tensors: dict[str, Any] = {}
    objects: dict[str, np.ndarray] = {}
    derived: list[str] = []
    token_columns: list[str] = []
    response_lengths = None
    if seq:
        _check_sequence(columns, prompt, response)
        made = verl_sequences(
            batch.ragged(prompt),
            batch.ragged(response),
            pad_token_id,
            prompt_length,
            response_length,
        )
        derived = [key for key in made if key not in columns]  # a column of that name wins
        tensors.update({key: made[key] for key in derived})
        width = made["responses"].shape[1]
        response_lengths = batch.ragged(response).lengths
    for name, column in columns.items():
        if seq and name in (prompt, response):
            continue
        if name in apart or column.kind in ("string", "object"):
            objects[name] = _numpy(batch, name, column)
        elif column.kind in ("scalar", "tensor"):
            tensors[name] = torch.from_numpy(np.array(batch.numpy(name)))
        elif layout == "nopad":
            tensors[name] = _nested(batch.ragged(name))
        elif response_lengths is not None and _aligned(batch.ragged(name), response_lengths):
            values, _ = batch.ragged(name).padded(0, width, False)
            tensors[name] = torch.from_numpy(np.array(values))
            token_columns.append(name)
        else:
            objects[name] = _numpy(batch, name, column)
    if "uid" not in columns:  # verl's GRPO group key
        objects["uid"] = _object_array([str(g) for g in batch.meta.groups])
        derived.append("uid")
    rows, tasks = rows_of(batch.meta)
    tensors[ROWS_KEY] = torch.from_numpy(rows)
    objects[TASK_KEY] = tasks
    info = dict(meta_info or {})
    info[META_KEY] = {
        "layout": layout,
        "sequence": [prompt, response] if seq else [],
        "derived": derived,
        "token_columns": token_columns,
        "non_tensor": sorted(apart),
        "columns": [[c.name, c.kind, c.dtype, list(c.shape)] for c in columns.values()],
    }
    dp = DataProto.from_dict(tensors=tensors, non_tensors=objects, meta_info=info)
    dp.check_consistency()
    return dp


def from_dataproto(
    dp: Any, *, prompt: str = "prompt_ids", response: str = "response_ids", pad_token_id: int = 0
) -> Batch:
    """The :class:`~flowrl.Batch` a DataProto holds: every key, ``to_dataproto`` gives it
    back equal.

    A ``to_dataproto`` result (or a chunk, concat, reorder or union of some) comes back as
    the columns it was made from, plus a column per key verl added. Any other DataProto
    (one verl built): ``prompts``/``responses`` become the ragged ``prompt``/``response``
    columns, lengths from ``attention_mask`` (their padding must be ``pad_token_id``);
    ``input_ids``/``position_ids`` are left out when ``to_dataproto`` rebuilds them equal;
    every other key becomes a column (``_dataproto_infer``).

    ``batch.meta`` acks the claim when every row comes from one (``hub.ack``); for rows of
    several claims (verl's ``concat``) use :func:`ack_dataproto`.
    """
    _check_dataproto(dp)
    info = dp.meta_info.get(META_KEY) if isinstance(dp.meta_info, Mapping) else None
    if info is not None:
        columns, values, used = _made_columns(dp, info)
    else:
        columns, values, used = verl_sequence_columns(dp, prompt, response, pad_token_id)
    for key in tensor_keys(dp):
        if key not in used and key != ROWS_KEY:
            columns[key], values[key] = infer_tensor(key, dp.batch[key])
    for key, array in dp.non_tensor_batch.items():
        if key not in used and key != TASK_KEY:
            columns[key], values[key] = infer_array(key, array)
    n = len(dp)
    arrays = {name: encode(columns[name], values[name], n, _WHERE).array for name in columns}
    meta = batch_meta(dp, tuple(columns), sum(a.nbytes for a in arrays.values()))
    return Batch(meta, arrays, columns)


# -- a DataProto to_dataproto made ----------------------------------------------------------
def _made_columns(
    dp: Any, info: Mapping[str, Any]
) -> tuple[dict[str, Column], dict[str, Any], set[str]]:
    columns = {
        name: Column(name, kind, dtype, tuple(shape))
        for name, kind, dtype, shape in info["columns"]
    }
    _check_keys(dp, info)
    prompt, response = info["sequence"] or (None, None)
    if prompt is not None:
        prompts, responses = unpad(dp)
    values: dict[str, Any] = {}
    for name, column in columns.items():
        where = _placement(name, column.kind, info)
        if name in (prompt, response):
            r = prompts if name == prompt else responses
            values[name] = RaggedArray(r.values.astype(column.np_dtype), r.cu_seqlens)
        elif where == "apart":
            array = dp.non_tensor_batch[name]
            values[name] = array if column.kind in ("scalar", "tensor") else list(array)
        elif where == "dense":
            values[name] = host(dp.batch[name])
        elif where == "nested":
            values[name] = unnest(dp.batch[name])
        else:  # a token column: the response's lengths
            values[name] = RaggedArray.from_padded(host(dp.batch[name]), responses.lengths)
    used = {*columns, *info["derived"]}
    return columns, values, used


def _check_keys(dp: Any, info: Mapping[str, Any]) -> None:
    """Every key from_dataproto reads is there (verl code may have popped some)."""
    tensors = tensor_keys(dp)
    want = {ROWS_KEY} | (set(LAYOUT_KEYS) if info["sequence"] else set())
    objects = {TASK_KEY}
    for name, kind, _, _ in info["columns"]:
        if name not in info["sequence"]:
            (objects if _placement(name, kind, info) == "apart" else want).add(name)
    missing = sorted((want - tensors) | (objects - set(dp.non_tensor_batch)))
    if missing:
        raise SchemaError(
            f"from_dataproto(): the DataProto lacks {missing}, which to_dataproto wrote; "
            "pop keys from a copy (dp.select(...)) rather than from the batch you convert back"
        )


def _placement(name: str, kind: str, info: Mapping[str, Any]) -> str:
    """Where to_dataproto put a column: apart (non_tensor_batch), dense, nested or tokens."""
    if name in info["non_tensor"] or kind in ("string", "object"):
        return "apart"
    if kind in ("scalar", "tensor"):
        return "dense"
    if info["layout"] == "nopad":
        return "nested"
    return "tokens" if name in info["token_columns"] else "apart"


# -- padded layout ------------------------------------------------------------------------
def _aligned(r: RaggedArray, response_lengths: np.ndarray) -> bool:
    return np.array_equal(r.lengths, response_lengths)


def _nested(r: RaggedArray) -> Any:
    import torch

    return torch.nested.nested_tensor_from_jagged(
        torch.from_numpy(np.array(r.values)), offsets=torch.from_numpy(np.array(r.cu_seqlens))
    )


# -- checks and helpers -------------------------------------------------------------------
def _check_dataproto(dp: Any) -> None:
    if not all(hasattr(dp, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise ConfigError(f"from_dataproto() expects a verl DataProto, got {type(dp).__name__}")


def _check_non_tensor(names: Sequence[str], columns: Mapping[str, Column]) -> set[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"to_dataproto() non_tensor must be a list of column names, got {names!r}"
        )
    unknown = sorted(set(names) - set(columns))
    if unknown:
        raise SchemaError(
            f"to_dataproto() non_tensor names {unknown}, which are not columns of the batch "
            f"(it has {list(columns)})"
        )
    return set(names)


def _check_sequence(columns: Mapping[str, Column], prompt: str, response: str) -> None:
    for name in (prompt, response):
        c = columns[name]
        if c.kind != "ragged" or c.np_dtype.kind not in "iu":
            raise SchemaError(
                f"to_dataproto(): column {c.name!r} must hold ragged integer token ids, got "
                f"{c.describe()}; pass prompt=/response= naming the token columns"
            )
    clash = [k for k in LAYOUT_KEYS if k in columns]
    if clash:
        raise SchemaError(
            f"to_dataproto(): columns {clash} would replace the keys verl's padded layout is "
            f"read back from ({', '.join(LAYOUT_KEYS)}); rename them or pass layout='nopad'"
        )


def _numpy(batch: Batch, name: str, column: Column) -> np.ndarray:
    """A column as a ``non_tensor_batch`` array."""
    if column.kind in ("scalar", "tensor"):
        return np.array(batch.numpy(name))
    if column.kind == "ragged":
        return _object_array([np.array(s) for s in batch.ragged(name)])
    return _object_array(batch[name])


def _object_array(values: Any) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
