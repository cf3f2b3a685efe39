"""verl's padded sequence layout: building it, reading it back, and checking a DataProto
verl built against it.

verl's workers read ``prompts`` (left-padded), ``responses`` (right-padded),
``input_ids = cat(prompts, responses)``, ``attention_mask`` (1 on real tokens),
``position_ids`` (verl's ``compute_position_id_with_mask``) and ``response_mask``. The
lengths of a row's prompt and response are the sums of ``attention_mask`` over each part.
A DataProto verl built is taken as ragged prompt/response columns only when rebuilding
its layout from those lengths gives ``prompts``, ``responses`` and ``attention_mask`` back
equal, so the round trip never loses a token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import SchemaError
from flowrl.integrations._dataproto_infer import host

__all__ = ["LAYOUT_KEYS", "tensor_keys", "unpad", "verl_sequence_columns", "verl_sequences"]

# from_dataproto unpads with these three: in the padded layout they are never a column
LAYOUT_KEYS = ("prompts", "responses", "attention_mask")


def unpad(dp: Any) -> tuple[RaggedArray, RaggedArray]:
    """Left-padded prompts and right-padded responses, lengths from attention_mask."""
    prompts = host(dp.batch["prompts"])
    responses = host(dp.batch["responses"])
    attention = host(dp.batch["attention_mask"])
    width = prompts.shape[1]
    p_lengths = attention[:, :width].sum(axis=1).astype(np.int64)
    r_lengths = attention[:, width:].sum(axis=1).astype(np.int64)
    p_mask = np.arange(width) >= (width - p_lengths)[:, None]
    p_cu = np.zeros(len(p_lengths) + 1, dtype=np.int64)
    np.cumsum(p_lengths, out=p_cu[1:])
    return RaggedArray(prompts[p_mask], p_cu), RaggedArray.from_padded(responses, r_lengths)


# -- a DataProto verl built -----------------------------------------------------------------
def verl_sequence_columns(
    dp: Any, prompt: str, response: str, pad: int
) -> tuple[dict[str, Column], dict[str, Any], set[str]]:
    """verl's padded sequence as ragged ``prompt``/``response`` columns, when the DataProto
    has it; checked to come back equal from ``to_dataproto(pad_token_id=pad)``."""
    keys = tensor_keys(dp)
    if not keys.issuperset(LAYOUT_KEYS):
        return {}, {}, set()
    tensors = dp.batch
    for name in (prompt, response):
        if name in keys or name in dp.non_tensor_batch:
            raise SchemaError(
                f"from_dataproto(): the DataProto has a key {name!r} and verl's padded "
                f"sequence, which becomes column {name!r}; pass prompt=/response= naming "
                "columns it does not have"
            )
    prompts, responses = unpad(dp)
    made = verl_sequences(
        prompts, responses, pad, tensors["prompts"].shape[1], tensors["responses"].shape[1]
    )
    for key in LAYOUT_KEYS:
        _check_rebuilt(key, made[key], tensors[key], pad)
    rebuilt = keys & {"input_ids", "position_ids"}
    used = {*LAYOUT_KEYS, *(k for k in rebuilt if _equal(made[k], tensors[k]))}
    columns = {
        prompt: Column.ragged(prompt, prompts.dtype.name),
        response: Column.ragged(response, responses.dtype.name),
    }
    return columns, {prompt: prompts, response: responses}, used


def _check_rebuilt(key: str, made: Any, got: Any, pad: int) -> None:
    if _equal(made, got):
        return
    if made.dtype != got.dtype or made.shape != got.shape:
        found = f"{got.dtype} of shape {tuple(got.shape)}, expected {made.dtype}"
    else:
        row, col = (int(i) for i in (made != got.cpu()).nonzero()[0])
        found = (
            f"row {row} holds {int(got[row, col])} at position {col} where verl's layout "
            f"has {int(made[row, col])}"
        )
    raise SchemaError(
        f"from_dataproto(): batch[{key!r}] is not verl's padded layout (prompts left-padded "
        f"and responses right-padded with pad_token_id={pad}, attention_mask 1 on their "
        f"tokens, int64): {found}; pass the pad_token_id verl padded with "
        "(the tokenizer's) or build the batch in that layout"
    )


def _equal(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.cpu())


# -- the layout -------------------------------------------------------------------------------
def verl_sequences(
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
        # verl's compute_position_id_with_mask
        "position_ids": torch.clip(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": torch.from_numpy(r_mask.astype(np.int64)),
    }


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


def tensor_keys(dp: Any) -> set[str]:
    return set(dp.batch.keys()) if dp.batch is not None else set()  # TensorDict has no `in`
