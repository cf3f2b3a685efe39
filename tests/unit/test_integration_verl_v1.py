"""verl 0.9.1's V1 trainer data path on flowrl.compat.transfer_queue (skipped without verl).

What runs is verl's own code, unchanged: ``PPOTrainerSync`` built from verl's
``ppo_trainer.yaml`` submits prompts (``_submit_batch_to_rollout``), verl's
``AgentLoopWorkerTQ`` runs an agent loop registered with verl's ``register`` and writes
trajectories and group statuses, the replay buffer (``trainer.v1.sampler.custom_sampler``
= flowrl's ``HubReplayBuffer``) samples whole groups, ``_compute_old_log_prob`` (bypass
mode) and ``_compute_advantage`` read and write fields, and the batch is cleared as
``fit`` does. What cannot run on CPU is left out: the model workers (log-prob recompute,
update) and the LLM servers, for which the agent loop stands in. The worker is made
without its ``__init__`` (which loads a Hugging Face model and tokenizer); the attributes
its TransferQueue path reads are set from the same config.

CI runs these in the verl venv (.ci/run, ``pytest -m verl``).
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.verl

verl = pytest.importorskip("verl", reason="verl==0.9.1 is not installed (see docs/verl.md)")
torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from flowrl.errors import ConfigError  # noqa: E402

GROUP = 4  # rollout.n
PROMPTS = 4  # data.train_batch_size (prompts, i.e. groups, per step)


@pytest.fixture(scope="module")
def v1():
    """verl's V1 modules imported with transfer_queue = flowrl's compat module; the real
    TransferQueue (if installed) is put back for the other test modules afterwards."""
    from flowrl.integrations import verl_v1

    before = sys.modules.get("transfer_queue")
    verl_v1.use_flowrl_transfer_queue()  # verl itself is imported already (importorskip)
    from verl.trainer.ppo.v1 import (  # registers the trainers
        agent_loop_tq,
        replay_buffer,
        trainer_base,
        trainer_colocate_async,  # noqa: F401
        trainer_sync,
    )

    yield {
        "agent_loop_tq": agent_loop_tq,
        "replay_buffer": replay_buffer,
        "trainer_base": trainer_base,
        "trainer_sync": trainer_sync,
        "verl_v1": verl_v1,
    }
    if before is not None:
        verl_v1.route_transfer_queue(before)
    else:
        sys.modules.pop("transfer_queue", None)


def test_transfer_queue_submodules_follow_the_package(v1) -> None:
    import transfer_queue.metadata
    import transfer_queue.sampler

    import flowrl.compat.transfer_queue as compat

    assert sys.modules["transfer_queue"] is compat
    assert transfer_queue.metadata.BatchMeta is compat.metadata.BatchMeta
    assert transfer_queue.sampler.RankAwareSampler is compat.sampler.RankAwareSampler


@pytest.fixture
def tq(v1):
    import flowrl.compat.transfer_queue as compat

    compat.init(_config().transfer_queue)
    yield compat
    compat.close()


def _config(mode: str = "sync", sampler: str = "HubReplayBuffer", **sampler_kwargs):
    from hydra import compose, initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        f"trainer.v1.trainer_mode={mode}",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={GROUP}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=flowrl_echo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.bypass_mode=true",
        "trainer.v1.sampler.custom_sampler.path=pkg://flowrl.integrations.verl_v1",
        f"trainer.v1.sampler.custom_sampler.name={sampler}",
        *(f"++trainer.v1.sampler.sampler_kwargs.{k}={v}" for k, v in sampler_kwargs.items()),
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@register("flowrl_echo")
class EchoAgentLoop(AgentLoopBase):
    """Stands in for the LLM server: answers after a random delay (stragglers finish out
    of order); the response reverses the prompt, with a length and a reward that vary by
    session. Registered with verl's ``register``, built by verl's worker."""

    def __init__(self, trainer_config, **kwargs):  # no tokenizer: nothing to tokenize
        self.config = trainer_config.config

    async def run(self, sampling_params, **kwargs):
        prompt = kwargs["prompt_tokens"].tolist()
        session = int(kwargs["session_id"])
        await asyncio.sleep(random.random() * 0.05)
        response = prompt[::-1][: 1 + (session + len(prompt)) % 3]
        steps = int(kwargs["global_steps"])
        return AgentLoopOutput(
            prompt_ids=prompt,
            response_ids=response,
            response_mask=[1] * len(response),
            response_logprobs=[-0.5] * len(response),
            reward_score=float((session * 7 + prompt[0]) % 3),
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={"min_global_steps": steps, "max_global_steps": steps},
        )


class InProcessAgentLoops:
    """AgentLoopManagerTQ's job (dispatch prompts to AgentLoopWorkerTQ, return at once)
    for one worker on an event loop thread here instead of Ray actors."""

    def __init__(self, v1, config) -> None:
        worker_cls = v1["agent_loop_tq"].AgentLoopWorkerTQ.__ray_metadata__.modified_class
        worker = object.__new__(worker_cls)
        worker.config = config
        worker.llm_client = worker.tokenizer = worker.processor = worker.dataset_cls = None
        worker.hf_model_type = None
        worker.tools = []
        worker.reward_loop_worker_handles = None
        worker.teacher_client = None
        worker.distillation_enabled = False
        worker.background_tasks = set()
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def generate_sequences(self, prompts) -> None:
        asyncio.run_coroutine_threadsafe(self.worker.generate_sequences(prompts), self.loop).result(
            timeout=60
        )

    def close(self) -> None:
        async def drain():
            while self.worker.background_tasks:
                await asyncio.sleep(0.01)

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _prompts(first: int, count: int, step: int):
    """A dataloader batch as verl's trainer hands it to the agent loops."""
    import uuid

    from verl.utils import tensordict_utils as tu

    batch = tu.get_tensordict(
        {
            "prompt_tokens": torch.arange(first, first + count).unsqueeze(1) * 10
            + torch.arange(1, 4),
            "index": np.arange(first, first + count),
            "uid": np.array([str(uuid.uuid4()) for _ in range(count)], dtype=object),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


def _trainer(v1, config, agent_loops):
    trainer_cls = v1["trainer_base"].get_trainer_cls(config.trainer.v1.trainer_mode)
    trainer = trainer_cls(config=config)
    trainer.agent_loop_manager = agent_loops
    trainer.global_steps = 1
    return trainer


def _check_advantages(tq, batch) -> None:
    """The advantages verl wrote back are GRPO's on each uid's outcome scores."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    data = tq.kv_batch_get(
        keys=batch.keys,
        partition_id=batch.partition_id,
        select_fields=["advantages", "rm_scores", "response_mask", "uid"],
    )
    mask = data["response_mask"].to_padded_tensor(0)
    scores = data["rm_scores"].to_padded_tensor(0.0)
    uids = np.array(list(data["uid"]), dtype=object)
    expected, _ = compute_grpo_outcome_advantage(scores, mask, uids)
    torch.testing.assert_close(data["advantages"].to_padded_tensor(0.0), expected)


def test_sync_trainer_samples_whole_groups_once(v1, tq) -> None:
    """Three sync steps: each samples the step's groups whole, advantages are GRPO's, and
    after the trainer clears its batches nothing is left in the hub."""
    config = _config()
    agent_loops = InProcessAgentLoops(v1, config)
    trainer = _trainer(v1, config, agent_loops)
    assert type(trainer.replay_buffer).__name__ == "HubReplayBuffer"
    served: list[str] = []
    submitted: list[str] = []
    try:
        for step in range(1, 4):
            trainer.global_steps = step
            prompts = _prompts(PROMPTS * step, PROMPTS, step)
            submitted += list(prompts["uid"])
            trainer._submit_batch_to_rollout(prompts)
            batch, _ = trainer.replay_buffer.sample(
                global_steps=step, partition_id="train", batch_size=PROMPTS
            )
            metrics: dict = {}
            batch = trainer._compute_old_log_prob(batch, metrics)
            batch = trainer._compute_advantage(batch, metrics)
            _check_advantages(tq, batch)
            served += batch.keys
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)  # as fit() does
        _validate_once(tq, trainer, agent_loops)
    finally:
        agent_loops.close()
    assert len(served) == len(set(served)) == 3 * PROMPTS * GROUP  # no duplicates
    per_uid = Counter(key.rsplit("_", 2)[0] for key in served)
    assert sorted(per_uid) == sorted(submitted)  # nothing lost
    assert set(per_uid.values()) == {GROUP}  # whole groups
    assert not any(tq.kv_list().values())  # every partition empty
    assert tq.get_client().hub.statistics().live == 0


def _validate_once(tq, trainer, agent_loops) -> None:
    """_validate's steps 1-2: prompts registered in partition 'val', generated with
    validate=True, sampled from 'val' (val_kwargs.n sessions each); training untouched."""
    from verl.utils import tensordict_utils as tu

    prompts = _prompts(100, 3, trainer.global_steps)
    tu.assign_non_tensor_data(prompts, "validate", True)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": trainer.global_steps}] * 3
    tq.kv_batch_put(keys=list(prompts["uid"]), partition_id="val", tags=tags)
    agent_loops.generate_sequences(prompts)
    batch, _ = trainer.replay_buffer.sample(
        global_steps=trainer.global_steps, partition_id="val", batch_size=3
    )
    n = trainer.config.actor_rollout_ref.rollout.val_kwargs.n
    assert batch.partition_id == "val" and len(batch) == 3 * n
    assert {k.rsplit("_", 2)[0] for k in batch.keys} == set(prompts["uid"])
    assert "train" not in tq.kv_list() or not tq.kv_list()["train"]
    tq.kv_clear(keys=batch.keys, partition_id="val")


def test_async_buffer_wakes_on_a_change_not_a_poll_interval(v1, tq) -> None:
    """colocate_async with HubReplayBufferAsync and poll_interval=600 s: each step's sample
    starts waiting before its prompts are submitted, and returns once their groups finish
    (a change in the key directory wakes it: a 600 s sleep would not return in time);
    every group is served whole and once."""
    config = _config("colocate_async", "HubReplayBufferAsync", poll_interval=600)
    agent_loops = InProcessAgentLoops(v1, config)
    trainer = _trainer(v1, config, agent_loops)
    buffer = trainer.replay_buffer
    assert type(buffer).__name__ == "HubReplayBufferAsync" and buffer.poll_interval == 600
    submitted: list[str] = []
    served: list[str] = []
    try:
        for step in (1, 2, 3):
            trainer.global_steps = step
            result: list = []
            buffer._seen = -1
            sampler = threading.Thread(
                target=_sample_into, args=(buffer, step, result), daemon=True
            )
            sampler.start()
            deadline = time.monotonic() + 120
            while buffer._seen == -1 and time.monotonic() < deadline:
                time.sleep(0.01)  # until the buffer has looked once and waits
            assert buffer._seen != -1 and not result
            prompts = _prompts(PROMPTS * step, PROMPTS, step)
            submitted += list(prompts["uid"])
            trainer._submit_batch_to_rollout(prompts)
            sampler.join(timeout=300)
            assert result, "the replay buffer did not wake up when the groups finished"
            batch, _ = result[0]
            served += batch.keys
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    finally:
        agent_loops.close()
    assert len(served) == len(set(served)) == 3 * PROMPTS * GROUP
    per_uid = Counter(key.rsplit("_", 2)[0] for key in served)
    assert sorted(per_uid) == sorted(submitted) and set(per_uid.values()) == {GROUP}
    assert tq.get_client().hub.statistics().live == 0


def _sample_into(buffer, step: int, result: list) -> None:
    result.append(buffer.sample(global_steps=step, partition_id="train", batch_size=PROMPTS))


def test_sampler_config_mistakes_are_refused(v1, tq) -> None:
    with pytest.raises(ConfigError, match="samples with HubReplayBufferAsync"):
        _trainer(v1, _config("colocate_async", "HubReplayBuffer"), None)
    with pytest.raises(ConfigError, match=r"sampler_kwargs \['poll'\] are not understood"):
        _trainer(v1, _config("sync", "HubReplayBuffer", poll=1), None)
    v1["verl_v1"].use_flowrl_transfer_queue()  # again: harmless
    import flowrl.compat.transfer_queue as compat

    assert sys.modules["transfer_queue"] is compat
    assert v1["replay_buffer"].tq is compat and v1["trainer_base"].KVBatchMeta is compat.KVBatchMeta


def test_example_runs() -> None:
    """examples/verl_v1_replay_buffer.py, in its own process (it routes transfer_queue
    before importing verl, as a job's processes do)."""
    import subprocess

    path = Path(__file__).resolve().parents[2] / "examples" / "verl_v1_replay_buffer.py"
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "{'groups': 12, 'trajectories': 48}"


class _LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the largest dense tensor any torch call returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in torch.utils._pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor) and not value.is_nested:
                self.nbytes = max(self.nbytes, value.numel() * value.element_size())
        return out


def test_a_steps_memory_is_linear_in_the_batch_size(v1, tq) -> None:
    """Issue 24, item 1: verl pads what kv_batch_get returns (``to_padded_tensor``); with
    jagged fields padded to the batch's token count, the largest tensor of a step grew with
    the square of the batch. Four times the groups, at most four times the bytes."""
    config = _config()
    agent_loops = InProcessAgentLoops(v1, config)
    trainer = _trainer(v1, config, agent_loops)
    largest = []
    try:
        for step, prompts in enumerate((PROMPTS, 4 * PROMPTS), start=1):
            trainer.global_steps = step
            trainer._submit_batch_to_rollout(_prompts(100 * step, prompts, step))
            batch, _ = trainer.replay_buffer.sample(
                global_steps=step, partition_id="train", batch_size=prompts
            )
            with _LargestTensor() as seen:
                batch = trainer._compute_old_log_prob(batch, {})
                batch = trainer._compute_advantage(batch, {})
            _check_advantages(tq, batch)
            largest.append(seen.nbytes)
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    finally:
        agent_loops.close()
    assert 0 < largest[1] <= 4 * largest[0], largest
