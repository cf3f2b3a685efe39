"""The ready queue behind every claim: FIFO order, front pushes, rewrites, and a buffer
that stays proportional to what it holds however many samples stream through it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl._controller.tasks import ReadyQueue


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_queue_matches_a_list_and_its_buffer_stays_bounded(data: st.DataObject) -> None:
    q = ReadyQueue()
    model: list[int] = []
    counter = 0
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        op = data.draw(st.sampled_from(["back", "front", "drop", "replace"]), label="op")
        if op in ("back", "front"):
            k = data.draw(st.integers(0, 1500), label="k")
            new = list(range(counter, counter + k))
            counter += k
            if op == "back":
                q.push_back(np.array(new, dtype=np.int64))
                model += new
            else:
                q.push_front(np.array(new, dtype=np.int64))
                model[:0] = new
        elif op == "drop" and model:
            k = data.draw(st.integers(1, len(model)), label="drop")
            q.drop_front(k)
            del model[:k]
        elif op == "replace":
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
            mask = rng.random(len(model)) < data.draw(st.floats(0, 1), label="kept")
            q.replace(q.view()[mask])  # as the controller rewrites it
            model = [i for i, m in zip(model, mask.tolist(), strict=True) if m]
        assert q.view().tolist() == model
        assert len(q) == len(model)
        assert q.view(5).tolist() == model[:5]
        assert q._buf.size <= 8 * (len(model) + 1500 + 1024)


def test_a_queue_streamed_through_keeps_its_buffer() -> None:
    """A FIFO claim drops the head and a put pushes at the back: the buffer is compacted in
    place, not doubled (it used to double every time the tail reached its end)."""
    q = ReadyQueue()
    q.push_back(np.arange(1000, dtype=np.int64))
    sizes = set()
    for i in range(20_000):
        q.drop_front(32)
        q.push_back(np.arange(1000 + 32 * i, 1032 + 32 * i, dtype=np.int64))
        sizes.add(q._buf.size)
    assert q.view().tolist() == list(range(640_000, 641_000))
    assert max(sizes) <= 8192 and len(sizes) <= 2
