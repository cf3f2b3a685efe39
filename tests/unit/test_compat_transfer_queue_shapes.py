"""Jagged fields read through flowrl.compat.transfer_queue pad to their longest row, as
TransferQueue's do (issue 24, item 1): before, ``to_padded_tensor`` was as wide as the
whole batch's token count, memory quadratic in the batch size. The side-by-side check with
the real TransferQueue is tests/integration/test_compat_transfer_queue_conformance.py."""

from __future__ import annotations

import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402

TensorDict = tensordict.TensorDict


@pytest.fixture
def q():
    tq.init({"flowrl": {"fetch_timeout": 0.2}})
    yield tq
    tq.close()


def _responses(lengths: list[int]):
    rows = [torch.arange(n, dtype=torch.int64) + 1 for n in lengths]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@pytest.mark.parametrize("lengths", [[509, 3, 17, 200] * 16, [1], [0, 4, 2]])
def test_kv_batch_get_pads_to_the_longest_row(q, lengths: list[int]) -> None:
    n = len(lengths)
    keys = [f"k{i}" for i in range(n)]
    fields = TensorDict(
        {
            "responses": _responses(lengths),
            "prompts": torch.ones(n, 7, dtype=torch.int64),
            "images": torch.zeros(n, 3, 2),
        },
        batch_size=n,
    )
    q.kv_batch_put(keys=keys, partition_id="p", fields=fields)
    got = q.kv_batch_get(keys=keys, partition_id="p")
    assert got["responses"].to_padded_tensor(0).shape == (n, max(lengths))
    assert got["prompts"].to_padded_tensor(0).shape == (n, 7)
    assert got["images"].to_padded_tensor(0).shape == (n, 3, 2)
    padded = got["responses"].to_padded_tensor(-1)
    for row, length in zip(padded, lengths, strict=True):
        assert row[:length].tolist() == list(range(1, length + 1))
        assert (row[length:] == -1).all()


def test_a_subset_of_keys_pads_to_its_own_longest_row(q) -> None:
    lengths = [5, 300, 2, 9]
    keys = ["a", "b", "c", "d"]
    q.kv_batch_put(
        keys=keys,
        partition_id="p",
        fields=TensorDict({"responses": _responses(lengths)}, batch_size=4),
    )
    got = q.kv_batch_get(keys=["a", "c", "d"], partition_id="p")["responses"]
    assert got.to_padded_tensor(0).shape == (3, 9)


def test_get_data_pads_to_the_longest_row(q) -> None:
    client = q.get_client()
    lengths = [4, 1, 30, 2, 2, 8]
    client.put(TensorDict({"responses": _responses(lengths)}, batch_size=6), partition_id="p")
    meta = client.get_meta(["responses"], 3, "p", task_name="train")
    first = client.get_data(meta)["responses"]
    assert first.to_padded_tensor(0).shape == (3, 30)
    meta = client.get_meta(["responses"], 3, "p", task_name="train")
    assert client.get_data(meta)["responses"].to_padded_tensor(0).shape == (3, 8)


def test_a_read_takes_new_fields_as_any_tensordict_does(q) -> None:
    """verl's trainer writes fields into what kv_batch_get returned (tensordict 0.10 refused
    a nested one when the batch size was kept as a list, not a torch.Size)."""
    q.kv_batch_put(keys=["a", "b"], partition_id="p",
                   fields=TensorDict({"responses": _responses([3, 2])}, batch_size=2))  # fmt: skip
    got = q.kv_batch_get(keys=["a", "b"], partition_id="p")
    assert type(got.batch_size) is torch.Size and got.batch_size == (2,)
    got["old_log_probs"] = torch.nested.as_nested_tensor(
        [torch.zeros(3), torch.zeros(2)], layout=torch.jagged
    )
    assert got["old_log_probs"].to_padded_tensor(1.0).shape == (2, 3)
