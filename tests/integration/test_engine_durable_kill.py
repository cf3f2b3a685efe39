"""A rollout worker on an engine SIGKILLed mid-generation: its replacement resumes from the
tokens the engine path appended, nothing lost, nothing generated twice.

A pipeline of prompts and a rollout stage that samples with a
:class:`~flowrl.engines.TorchRolloutEngine` through
:func:`flowrl.engines.durable.generate_durable` (appends every 2 engine steps) runs under
the process executor, two workers. The first rollout call anywhere kills its own process
right after its first append (the first 2 tokens of each response with their log-probs,
policy version 0), once the trainer has published version 1. The executor replaces the
worker; the lease on the batch expires; whichever worker claims it next continues each
response from the appended prefix (a worker that was sampling under version 0 loads
version 1 through ``poll_weights`` first), with version 1 for the new tokens.
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
from flowrl.engines import SamplingParams, TorchRolloutEngine
from flowrl.engines.durable import generate_durable
from flowrl.models import TinyLM, TinyLMConfig

pytestmark = pytest.mark.integration

KILLS = "FLOWRL_TEST_ENGINE_KILLS"
N = 24
MAX_NEW = 8
EOS = 2


@stage(outputs=[Column.ragged("prompt", "int64")], batch_size=4)
def prompts():
    for start in range(0, N, 4):
        yield {"prompt": [[3 + i % 7, 4 + i % 5, 5] for i in range(start, start + 4)]}


class _DieAfterFirstAppend:
    """The worker's real hub client; after the first append the process dies."""

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
        torch.set_num_threads(1)
        torch.manual_seed(0)
        cfg = TinyLMConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, max_seq_len=16)
        self.model = TinyLM(cfg).eval()
        self.hub = ctx.hub
        self.engine = TorchRolloutEngine(self.model, version=ctx.hub.version)

    def newer(self, have: int) -> tuple[int, Any] | None:
        """The trainer's versions: the same weights under a new number (enough here)."""
        version = self.hub.version
        return None if version == have else (version, list(self.model.named_parameters()))

    def __call__(self, batch: flowrl.Batch) -> Rows:
        hub: Any = self.hub
        record = Path(os.environ[KILLS]) / "victim.json"
        try:  # the first call anywhere volunteers
            os.close(os.open(record.with_suffix(".lock"), os.O_CREAT | os.O_EXCL))
            hub = _DieAfterFirstAppend(self.hub, record)
        except FileExistsError:
            pass
        out = generate_durable(
            self.engine,
            hub,
            batch.meta,
            batch.ragged("prompt").tolist(),
            SamplingParams(max_new_tokens=MAX_NEW, eos_id=EOS, seed=0),
            ids=batch.indices.tolist(),
            append_every=2,
            poll_weights=self.newer,
        )
        return Rows(
            {
                "response": out.responses,
                "sample_logprobs": out.logprobs,
                "response_versions": out.versions,
            },
            version=out.sample_versions(self.engine.version),
        )


def test_a_killed_engine_worker_is_resumed_from_its_appended_prefix(
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
            n, m = len(got["response"]), len(prefix)
            assert 1 <= m <= 2 and n <= MAX_NEW  # 2 engine steps: a token each (or EOS)
            assert got["response"][:m] == prefix
            assert got["sample_logprobs"][:m] == prefix_lp
            assert got["response_versions"] == [0] * m + [1] * (n - m)
            assert sample_versions[i] == 0  # as old as its oldest token
            assert EOS not in got["response"][:-1]
            mixed += n > m
        assert mixed >= 1
        # The others: the other worker may be mid-generation when version 1 lands (the
        # victim publishes it before dying), so a response may switch once, never back.
        for i in set(rows) - set(victim["indices"]):
            versions = rows[i]["response_versions"]
            assert versions == sorted(versions) and set(versions) <= {0, 1}, versions
            assert sample_versions[i] == versions[0]  # as old as its oldest token
    finally:
        hub.close()
