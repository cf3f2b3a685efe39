"""flowrl.compat.transfer_queue side by side with the real TransferQueue (the ``peer``
extra; skipped where it is not installed): the same data put into both, read back from
both, must come back with the same layout (issue 24, item 1: every jagged field pads to
the same shape)."""

from __future__ import annotations

import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")
real = pytest.importorskip("transfer_queue", reason="needs the peer extra (TransferQueue)")

import flowrl.compat.transfer_queue as compat  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.slow]

TensorDict = tensordict.TensorDict
LENGTHS = [509, 3, 17, 200, 64, 1, 77, 5] * 8  # 64 responses, the longest 509 tokens


@pytest.fixture(scope="module")
def both(ray_runtime):
    """TransferQueue on a local Ray, and the compat client's embedded hub."""
    from omegaconf import OmegaConf

    ray_runtime.single()
    conf = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}
    real.init(OmegaConf.create(conf))
    compat.init({"flowrl": {"fetch_timeout": 5.0}})
    yield real, compat
    compat.close()
    real.close()
    ray_runtime.shutdown()


def _fields() -> TensorDict:
    n = len(LENGTHS)
    rows = [torch.arange(length, dtype=torch.int64) for length in LENGTHS]
    return TensorDict(
        {
            "responses": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "prompts": torch.arange(n * 12, dtype=torch.int64).reshape(n, 12),
            "log_probs": torch.rand(n, 12),
            "images": torch.rand(n, 3, 4),
            "reward": torch.rand(n),
        },
        batch_size=n,
    )


def _padded_shapes(data) -> dict[str, tuple[int, ...]]:
    """Each field's shape, padded where it is jagged (what verl's trainer pads to)."""
    return {
        name: tuple(value.to_padded_tensor(0).shape if value.is_nested else value.shape)
        for name, value in data.items()
    }


def test_kv_batch_get_has_transferqueues_padded_shapes(both) -> None:
    fields = _fields()
    keys = [f"k{i}" for i in range(len(LENGTHS))]
    got = {}
    for name, tq in zip(("transferqueue", "flowrl"), both, strict=True):
        tq.kv_batch_put(keys=keys, partition_id="shapes", fields=fields)
        got[name] = tq.kv_batch_get(keys=keys, partition_id="shapes")
        tq.kv_clear(keys=keys, partition_id="shapes")
    theirs, ours = got["transferqueue"], got["flowrl"]
    assert _padded_shapes(ours) == _padded_shapes(theirs)
    assert _padded_shapes(ours)["responses"] == (64, 509)
    for name in fields.keys():  # noqa: SIM118 (iterating a TensorDict gives rows)
        assert ours[name].is_nested == theirs[name].is_nested, name
        assert torch.equal(_dense(ours[name]), _dense(theirs[name])), name


def test_get_data_has_transferqueues_padded_shapes(both) -> None:
    fields = _fields()
    got = {}
    for name, tq in zip(("transferqueue", "flowrl"), both, strict=True):
        client = tq.get_client()
        client.put(fields, partition_id="shapes_low")
        parts = []
        for _ in range(2):  # two batches: each pads to its own longest row
            meta = client.get_meta(
                data_fields=list(fields.keys()),
                batch_size=len(LENGTHS) // 2,
                partition_id="shapes_low",
                task_name="train",
            )
            parts.append(_padded_shapes(client.get_data(meta)))
        got[name] = parts
        client.clear_partition("shapes_low")
    assert got["flowrl"] == got["transferqueue"]


def test_a_cleared_partition_has_transferqueues_status_and_fills_again(both) -> None:
    """Issue 24: clear_partition unregisters the partition's hub tasks; what a program sees
    of the partition afterwards (status, listing, the same name filled again) is
    TransferQueue's."""
    got = {}
    for name, tq in zip(("transferqueue", "flowrl"), both, strict=True):
        client = tq.get_client()
        seen: list[object] = []

        def status(client=client, seen=seen) -> None:
            seen.append(client.check_consumption_status("t", "cleared"))
            seen.append("cleared" in client.get_partition_list())

        client.put(TensorDict({"x": torch.arange(4)}, batch_size=4), partition_id="cleared")
        client.get_meta(data_fields=["x"], batch_size=4, partition_id="cleared", task_name="t")
        status()
        client.clear_partition("cleared")
        status()
        client.put(TensorDict({"x": torch.arange(10, 12)}, batch_size=2), partition_id="cleared")
        status()
        again = client.get_meta(
            data_fields=["x"], batch_size=2, partition_id="cleared", task_name="t"
        )
        seen.append(_dense(client.get_data(again)["x"]).tolist())
        status()
        client.clear_partition("cleared")
        got[name] = seen
    assert got["flowrl"] == got["transferqueue"]
    assert got["flowrl"][:5] == [True, True, False, False, False]


def _dense(value):
    return value.to_padded_tensor(0) if value.is_nested else value
