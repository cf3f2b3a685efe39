"""A rollout worker SIGKILLed mid-generation: its replacement resumes from the prefix.

A pipeline of prompts and a durable rollout stage (``flowrl.rl.generate_resumable`` with a
real TinyLM) runs under the process executor. The first rollout call anywhere kills its
own process right after its first append (the tokens of the first decoding steps and their
log-probs, policy version 0), once the trainer has moved on to version 1. The executor
replaces the worker; the lease on the batch expires; whichever worker claims it next must
continue each response from the appended tokens, with version 1 for the new ones.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import flowrl
from flowrl import Column, Rows
from flowrl._pipeline.executors.processes import ProcessExecutor
from flowrl._pipeline.loader import Loader
from flowrl._pipeline.pipeline import Pipeline
from flowrl._pipeline.stage import StageContext, stage
from flowrl.models import TinyLM, TinyLMConfig
from flowrl.rl import generate_resumable

pytestmark = pytest.mark.integration

KILLS = "FLOWRL_TEST_PARTIAL_KILLS"
N = 24
MAX_NEW = 8
EOS = 2


@stage(outputs=[Column.ragged("prompt", "int64")], batch_size=4)
def prompts():
    for start in range(0, N, 4):
        yield {"prompt": [[3 + i % 7, 4 + i % 5, 5] for i in range(start, start + 4)]}


class _DieAfterFirstChunk:
    """The worker's real hub client; after the first chunk's append the process dies."""

    def __init__(self, hub: Any, record: Path) -> None:
        self.hub = hub
        self.record = record

    def partial(self, *args: Any, **kwargs: Any) -> Any:
        return self.hub.partial(*args, **kwargs)

    def append_async(self, meta: Any, chunk: dict[str, Any], *, version: int) -> Any:
        self.hub.append(meta, chunk, version=version)  # landed before the kill
        appends = {k: [np.asarray(v).tolist() for v in vals] for k, vals in chunk.items()}
        self.record.write_text(json.dumps({"indices": meta.indices.tolist(), **appends}))
        self.hub.publish_version(1)  # stands for the trainer moving on meanwhile
        os.kill(os.getpid(), signal.SIGKILL)


@stage(
    inputs=["prompt"],
    outputs=[
        Column.ragged("response", "int64"),
        Column.ragged("sample_logprobs", "float32"),
        Column.ragged("response_versions", "int64"),
    ],
    batch_size=4,
    workers=2,
    lease_timeout=1.0,
)
class Rollout:
    def setup(self, ctx: StageContext) -> None:
        torch.manual_seed(0)
        cfg = TinyLMConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, max_seq_len=16)
        self.model = TinyLM(cfg).eval()
        self.hub = ctx.hub

    def __call__(self, batch: flowrl.Batch) -> Rows:
        version = self.hub.version
        hub: Any = self.hub
        record = Path(os.environ[KILLS]) / "victim.json"
        try:  # the first call anywhere volunteers
            os.close(os.open(record.with_suffix(".lock"), os.O_CREAT | os.O_EXCL))
            hub = _DieAfterFirstChunk(self.hub, record)
        except FileExistsError:
            pass
        out = generate_resumable(
            self.model,
            hub,
            batch.meta,
            batch.ragged("prompt").tolist(),
            MAX_NEW,
            version=version,
            eos_id=EOS,
            append_every=2,
            generator=torch.Generator().manual_seed(int(batch.indices[0]) + 100 * version),
        )
        return Rows(
            {
                "response": out.responses,
                "sample_logprobs": out.logprobs,
                "response_versions": out.versions,
            },
            version=out.sample_versions(version),
        )


def test_a_killed_rollout_worker_is_resumed_from_its_appended_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILLS, str(tmp_path))
    pipe = Pipeline([prompts, Rollout])
    hub = flowrl.launch_hub(pipe.columns)
    columns = ["prompt", "response", "sample_logprobs", "response_versions"]
    try:
        loader = Loader(hub, task="train", columns=columns, batch_size=4, timeout=60)
        executor = ProcessExecutor(timeout=120, max_restarts=1)
        rows: dict[int, dict[str, Any]] = {}
        sample_versions: dict[int, int] = {}
        seen: list[int] = []
        with pipe.start(hub, executor=executor, loaders=[loader]) as run:
            for batch in loader:
                seen.extend(batch.indices.tolist())
                for k, i in enumerate(batch.indices.tolist()):
                    rows[i] = {c: batch.ragged(c)[k].tolist() for c in columns[1:]}
                    sample_versions[i] = int(batch.meta.versions[k])
        result = run.result()
        victim = json.loads((tmp_path / "victim.json").read_text())

        # Exact accounting: every prompt rolled out and trained on once, one restart.
        assert Counter(seen) == Counter(range(N))
        assert result.completed and result.stages["Rollout"].restarts == 1
        assert result.stages["Rollout"].samples == N  # the dead worker put nothing
        stats = hub.statistics()
        for task in ("Rollout", "train"):
            assert stats.tasks[task].consumed == N, task
            assert stats.tasks[task].ready == stats.tasks[task].leased == 0, task
        assert stats.live == 0 and stats.leases == 0

        # The killed batch was resumed from what was appended, not sampled again.
        mixed = 0
        for k, i in enumerate(victim["indices"]):
            prefix, prefix_lp = victim["response"][k], victim["sample_logprobs"][k]
            got = rows[i]
            n = len(got["response"])
            assert len(prefix) == 2 and n <= MAX_NEW
            assert got["response"][:2] == prefix
            assert got["sample_logprobs"][:2] == prefix_lp
            assert got["response_versions"] == [0, 0] + [1] * (n - 2)
            assert sample_versions[i] == 0  # as old as its oldest token
            mixed += n > 2
        assert mixed >= 1
        for i in set(rows) - set(victim["indices"]):  # the others: one version each
            assert len(set(rows[i]["response_versions"])) == 1
    finally:
        hub.close()
