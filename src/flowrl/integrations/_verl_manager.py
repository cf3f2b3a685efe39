"""HubAgentLoopManager: verl's agent-loop manager, with rollouts served from a flowrl hub.

verl 0.9.1's trainer builds it from ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
as ``Manager.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`` and
calls ``generate_sequences(prompts) -> DataProto`` once per step. This manager:

1. puts the step's prompts into the hub (``prompt_ids`` plus any ``non_tensor_batch`` key
   the hub declares as a column), one hub group per verl ``uid``: the hub's rollout stages
   (flowrl engines, vLLM, ...) stream responses into it;
2. ``serve: asked`` (default): waits for exactly those groups and returns them row for row
   in the order of ``prompts``, with their ``uid`` s, which RayPPOTrainer's
   ``batch.union(output)`` needs; ``serve: ready``: claims ``len(prompts)`` samples of
   *complete* groups, oldest first (GroupSampler), so a group still generating when the
   step has enough is carried over to the next call and served first there (for trainers
   that take the output as it comes); a partial group is never returned;
3. returns them in verl's padded layout (``to_dataproto``) and acks them.

Validation calls (``meta_info["validate"]``, RayPPOTrainer's ``_validate``) are served
apart: every row is put as its own sample in hub partition ``validate`` with no group (the
training claims take whole groups only, so they never see one), its response is read row
for row, and the samples are consumed before the call returns.

Samples the manager holds while it waits (other groups' or other rows') are leased to it
and given back, first in line, when the call returns; samples of a call that failed are
discarded when they turn up.

Settings come from a ``flowrl`` block of the verl config (``+flowrl.address=ipc://...``)::

    flowrl:
      address: ipc:///tmp/hub.sock  # flowrl.connect(); or override open_hub()
      task: verl_rollout            # the hub task the manager claims
      prompt_column: prompt_ids
      response_column: response_ids
      columns: []                   # more columns to return (rm_scores, rollout_log_probs)
      feed_prompts: true            # false: the hub's own prompt source feeds it
      serve: asked                  # asked | ready (see 2. above; ready when feed_prompts false)
      timeout: null                 # seconds one call may wait for complete groups
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np

from flowrl._client.base import HubClient
from flowrl._controller.samplers import GroupSampler
from flowrl._launch.processes import connect
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import ConfigError, EndOfStream, Timeout
from flowrl.integrations._dataproto import to_dataproto
from flowrl.integrations._verl_compat import require_verl

__all__ = ["HubAgentLoopManager"]

_POLL_S = 1.0
_CLAIM_ALL = 1 << 20  # samples one collecting claim may take
_SERVE = ("asked", "ready")


class HubAgentLoopManager:
    """Drop-in for verl's ``AgentLoopManager`` (same constructor and ``create``)."""

    def __init__(
        self,
        config: Any,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
    ) -> None:
        require_verl()
        from omegaconf import OmegaConf

        self.config = config if OmegaConf.is_config(config) else OmegaConf.create(config)
        self.llm_client = llm_client  # unused: generation runs in the hub's rollout stages
        self.teacher_client = teacher_client
        self.reward_loop_worker_handles = reward_loop_worker_handles
        self.group_size = int(self._setting("actor_rollout_ref.rollout.n", 1))
        self.task = str(self._setting("flowrl.task", "verl_rollout"))
        self.prompt_column = str(self._setting("flowrl.prompt_column", "prompt_ids"))
        self.response_column = str(self._setting("flowrl.response_column", "response_ids"))
        self.feed_prompts = bool(self._setting("flowrl.feed_prompts", True))
        self.serve = str(self._setting("flowrl.serve", "asked" if self.feed_prompts else "ready"))
        if self.serve not in _SERVE:
            raise ConfigError(f"HubAgentLoopManager flowrl.serve must be one of {_SERVE}, got "
                              f"{self.serve!r}")  # fmt: skip
        if self.serve == "asked" and not self.feed_prompts:
            raise ConfigError(
                "HubAgentLoopManager flowrl.serve=asked serves the groups of the prompts it "
                "puts, but flowrl.feed_prompts is false: use serve=ready"
            )
        self.timeout = self._setting("flowrl.timeout", None)
        self.prompt_length = self._setting("data.max_prompt_length", None)
        self.response_length = self._setting("actor_rollout_ref.rollout.response_length", None)
        extra = list(self._setting("flowrl.columns", []) or [])
        self.columns = (self.prompt_column, self.response_column, *extra)
        self.hub = self.open_hub()
        self.hub.register_task(self.task, self.columns)
        self._sampler = GroupSampler(self.group_size)
        self._uid_of: dict[int, str] = {}  # hub group -> verl uid of prompts we put
        self._next_group = 0
        self._abandoned: set[int] = set()  # samples of calls that failed: dropped when seen

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> HubAgentLoopManager:
        """How verl's trainer builds its manager (verl's own is awaited; this one is not)."""
        return cls(*args, **kwargs)

    def open_hub(self) -> HubClient:
        """The hub to serve from: ``flowrl.connect(config.flowrl.address)``; override to
        hand over a hub another way (an in-process ``flowrl.Hub`` in tests)."""
        address = self._setting("flowrl.address", None)
        if not address:
            raise ConfigError(
                "HubAgentLoopManager needs the hub's address: set flowrl.address in the verl "
                "config (+flowrl.address=ipc://...) or override open_hub()"
            )
        return connect(str(address))

    def generate_sequences(self, prompts: Any) -> Any:
        """The rollouts of ``prompts`` (see the module docstring), as verl's rollout output
        (``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
        ``response_mask``, ``uid`` and the extra columns)."""
        start = time.monotonic()
        if prompts.meta_info.get("validate", False):
            out = self._serve_rows(prompts, self._put_rows(prompts, -1, "validate"))
        elif self.serve == "asked":
            first = self._next_group
            out = self._serve_rows(prompts, self._put_prompts(prompts))
            for g in range(first, self._next_group):
                self._uid_of.pop(g, None)
        else:
            out = self._serve_ready(prompts)
        out.meta_info["timing"] = {"agent_loop/flowrl_wait": time.monotonic() - start}
        return out

    def _serve_ready(self, prompts: Any) -> Any:
        import torch

        if self.feed_prompts:
            self._put_prompts(prompts)
        meta = self._claim(len(prompts))
        out = self._dataproto(self.hub.get(meta), prompts)
        self.hub.ack(meta)
        uids = [self._uid_of.get(g, str(g)) for g in meta.groups.tolist()]
        for g in set(meta.groups.tolist()):
            self._uid_of.pop(g, None)
        out.non_tensor_batch["uid"] = np.array(uids, dtype=object)
        order = _input_order(prompts.non_tensor_batch.get("uid"), uids)
        if order is not None:
            out.reorder(torch.as_tensor(order))
        return out

    def _serve_rows(self, prompts: Any, indices: np.ndarray) -> Any:
        """The samples ``indices`` (one per row of ``prompts``), once all are ready, in
        that order with the rows' uids; other samples claimed meanwhile are given back."""
        held: list[_Held] = []
        try:
            self._collect(indices, held)
            out = self._dataproto(self.hub.get(self.hub.meta(indices, self.columns)), prompts)
            for claim in held:
                if claim.mine.size:
                    self.hub.ack(claim.meta, claim.meta.indices[claim.mine])
                    claim.open -= claim.mine.size
        except BaseException:
            self._abandoned.update(indices.tolist())
            raise
        finally:
            for claim in held:
                if claim.open:
                    self.hub.release(claim.meta)  # what was not ours, back first in line
        uids = prompts.non_tensor_batch.get("uid")
        if uids is not None:
            out.non_tensor_batch["uid"] = np.array(list(uids), dtype=object)
        return out

    def _collect(self, indices: np.ndarray, held: list[_Held]) -> None:
        """Claim until every sample of ``indices`` is held (in ``held``: each claim and
        the positions of ours in it); drop samples of failed calls on the way."""
        missing = set(indices.tolist())
        deadline = None if self.timeout is None else time.monotonic() + float(self.timeout)
        while missing:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(
                    f"HubAgentLoopManager waited {self.timeout}s for the rollouts of "
                    f"{len(indices)} prompts ({len(missing)} not ready) in task "
                    f"{self.task!r}; are the hub's rollout stages running?"
                )
            wait = _POLL_S if left is None else max(min(_POLL_S, left), 1e-3)
            lease = max(3600.0, 2 * float(self.timeout or 0))  # held ones must not expire
            try:
                meta = self.hub.claim(
                    self.task, _CLAIM_ALL, min_n=1, timeout=wait, lease_timeout=lease
                )
            except Timeout:
                continue
            except EndOfStream:
                raise EndOfStream(
                    f"HubAgentLoopManager: the hub's stream ended with {len(missing)} of "
                    f"{len(indices)} rollouts not ready in task {self.task!r}"
                ) from None
            claim = _Held(meta, np.flatnonzero(np.isin(meta.indices, list(missing))))
            held.append(claim)
            missing.difference_update(meta.indices[claim.mine].tolist())
            stale = [i for i in meta.indices.tolist() if i in self._abandoned]
            if stale:
                self.hub.drop(meta, stale)
                self._abandoned.difference_update(stale)
                claim.open -= len(stale)

    def _dataproto(self, batch: Any, prompts: Any) -> Any:
        return to_dataproto(
            batch,
            prompt=self.prompt_column,
            response=self.response_column,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            meta_info=dict(prompts.meta_info),
        )

    # -- steps ------------------------------------------------------------------------------
    def _put_prompts(self, prompts: Any) -> np.ndarray:
        """Put the prompts, one hub group per uid; the samples' indices, row by row."""
        uids = prompts.non_tensor_batch.get("uid")
        if uids is None:
            raise ConfigError(
                "HubAgentLoopManager.generate_sequences(): prompts carry no non_tensor_batch "
                "'uid' (verl's trainer adds one per prompt before repeating it rollout.n times)"
            )
        keys, first, local, sizes = np.unique(
            np.asarray([str(u) for u in uids]),
            return_index=True,
            return_inverse=True,
            return_counts=True,
        )
        if np.any(sizes != self.group_size):
            raise ConfigError(
                f"HubAgentLoopManager: every uid must appear rollout.n={self.group_size} times "
                f"in prompts, got group sizes {sorted(set(sizes.tolist()))}"
            )
        # hub groups numbered in order of first appearance, after every group put before
        rank = np.empty(keys.size, dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(keys.size)
        groups = self._next_group + rank[local]
        indices = self._put_rows(prompts, groups, "")  # checks all before changing the hub
        for key, g in zip(keys.tolist(), (self._next_group + rank).tolist(), strict=True):
            self._uid_of[g] = key
        self._next_group += keys.size
        return indices

    def _put_rows(self, prompts: Any, groups: Any, partition: str) -> np.ndarray:
        """One sample per row: the unpadded prompt and the columns the hub declares."""
        ids = prompts.batch["input_ids"].numpy()
        mask = prompts.batch["attention_mask"].numpy().astype(bool)
        data: dict[str, Any] = {
            self.prompt_column: RaggedArray.from_list([ids[i][mask[i]] for i in range(len(ids))])
        }
        declared = {c.name for c in self.hub.columns}
        for key, values in prompts.non_tensor_batch.items():
            if key in declared and key not in data:
                data[key] = list(values)
        return np.asarray(self.hub.put(data, groups=groups, partition=partition))

    def _claim(self, n: int) -> Any:
        if n % self.group_size:
            raise ConfigError(
                f"HubAgentLoopManager: {n} prompts is not a whole number of groups of "
                f"rollout.n={self.group_size}"
            )
        deadline = None if self.timeout is None else time.monotonic() + float(self.timeout)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            wait = _POLL_S if left is None else max(min(_POLL_S, left), 1e-3)
            try:
                meta = self.hub.claim(self.task, n, sampler=self._sampler, timeout=wait)
            except Timeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise Timeout(
                        f"HubAgentLoopManager waited {self.timeout}s for {n} samples of "
                        f"complete groups in task {self.task!r}; are the hub's rollout "
                        "stages running?"
                    ) from None
                continue
            except EndOfStream:
                raise EndOfStream(
                    f"HubAgentLoopManager: the hub's stream ended before {n} samples of "
                    f"complete groups were ready for task {self.task!r}"
                ) from None
            if len(meta) == n:
                return meta
            self.hub.release(meta)  # a short claim at the stream's end: nothing to serve
            raise EndOfStream(
                f"HubAgentLoopManager: the hub's stream ended with {len(meta)} samples of "
                f"complete groups left, fewer than the {n} a step needs"
            )

    def _setting(self, key: str, default: Any) -> Any:
        from omegaconf import OmegaConf

        return OmegaConf.select(self.config, key, default=default)


class _Held:
    """A claim ``_collect`` made: the positions of the samples it waits for in it, and how
    many of its samples are still leased (given back with ``release`` if any)."""

    __slots__ = ("meta", "mine", "open")

    def __init__(self, meta: Any, mine: np.ndarray) -> None:
        self.meta, self.mine, self.open = meta, mine, len(meta)


def _input_order(wanted: Any, served: list[str]) -> np.ndarray | None:
    """Positions of ``served`` that put it in the order of ``wanted`` (both list the same
    uids the same number of times); None when the served groups are not the asked ones."""
    if wanted is None or sorted(map(str, wanted)) != sorted(served):
        return None
    slots: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(served):
        slots[uid].append(i)
    return np.array([slots[str(u)].pop(0) for u in wanted], dtype=np.int64)
