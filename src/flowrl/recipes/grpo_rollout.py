"""How the Rollout stage samples: the builtin sampler or a rollout engine (``--engine``).

Each rollout worker gets a sampler from the run's :class:`RolloutBackend`; the stage hands
it every claimed micro-batch and puts what it returns (one row per sample: the response,
the sampler's log-probs and each token's policy version).

* ``builtin`` (:class:`BuiltinSampler`): the KV-cache sampler through
  :func:`flowrl.rl.generate_resumable` (durable token-granular appends, resumption from a
  stored prefix), loading a newer published version between micro-batches.
* ``torch`` / ``vllm`` (:class:`EngineSampler`): a :class:`~flowrl.engines.RolloutEngine`
  (:class:`~flowrl.engines.TorchRolloutEngine` over a copy of the policy, or
  ``VLLMRolloutEngine`` over the policy saved as a Hugging Face directory) through
  :func:`flowrl.engines.durable.generate_durable`. The micro-batch's prompts are added as
  requests (continuing each sample's stored prefix when ``--append-every`` > 0), the
  request id being the sample's position in the run's stream, and the engine steps until
  they finish, appending the new tokens to the hub every ``--append-every`` steps. Before
  adding them and before each step it checks the :class:`~flowrl.WeightStore`: a newer
  version is loaded with :meth:`~flowrl.engines.RolloutEngine.update_weights`, which
  resumes the running requests from their prefixes under it, so a response may mix
  versions, each token tagged with its own; the stage puts the sample with its oldest
  token's version, as the builtin sampler does.

Each sample's random stream is seeded from ``--seed`` and its position in the run's stream
(the builtin sampler seeds a micro-batch from its first sample's), so a synchronous run
with one worker resumed from a checkpoint samples what the uninterrupted run would have.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

import flowrl
from flowrl.engines import GenerationRequest, RolloutEngine, SamplingParams, TorchRolloutEngine
from flowrl.engines.durable import generate_durable
from flowrl.models import as_causal_lm
from flowrl.recipes.grpo_config import GRPOConfig
from flowrl.recipes.grpo_task import context_len
from flowrl.rl import generate_resumable
from flowrl.rl.rollout import ResumableGeneration
from flowrl.tasks import EOS_ID, PAD_ID

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl.models import CausalLM

__all__ = ["BuiltinSampler", "EngineSampler", "RolloutBackend", "Sampler", "WeightSource"]


class WeightSource(Protocol):
    """Where the samplers get the newest published weights: the trainer's
    :class:`~flowrl.WeightStore` in its process, or a shared-memory subscriber in a
    rollout process of its own (``flowrl.recipes.grpo_rollout_process``)."""

    def pull(self, model: torch.nn.Module, have: int) -> int:
        """Load the newest version into ``model`` if it is not ``have``; returns it."""
        ...

    def newer(self, have: int) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The newest version and a copy of its tensors if it is not ``have``, else None."""
        ...


class Sampler(Protocol):
    """One rollout worker's way to sample a claimed micro-batch."""

    @property
    def version(self) -> int:
        """The policy version it samples new tokens with."""
        ...

    def generate(self, batch: flowrl.Batch) -> ResumableGeneration: ...


class RolloutBackend:
    """Makes each rollout worker's sampler (``cfg.engine``); :meth:`close` releases the
    engines and files they hold at the end of the run.

    ``first_sample``: the position of the hub's sample 0 in the run's stream (a resumed
    run's hub starts over at 0).
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        store: WeightSource,
        reference: torch.nn.Module,
        max_new: int,
        *,
        first_sample: int = 0,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.reference = reference
        self.max_new = max_new
        self.first_sample = first_sample
        self._engines: list[RolloutEngine] = []
        self._folders: list[str] = []
        self._ready: list[RolloutEngine] = []  # built ahead (prepare), not a worker's yet
        # Intra-op threads are set per OS thread (OpenMP): a worker thread starts with the
        # library's default, not the process's setting (e.g. its pinned cores). Workers
        # take this thread's, as an engine built here (prepare) was.
        self._threads = torch.get_num_threads()

    def prepare(self, workers: int) -> None:
        """Build the engines of ``workers`` rollout workers now, if building one takes long
        (a vLLM engine: seconds), so the run's first step does not wait for it. They hold
        the policy as built here (no version yet) and load the newest published version
        before they sample anything (``generate_durable``)."""
        while self.cfg.engine == "vllm" and len(self._ready) < workers:
            engine = self._vllm(copy.deepcopy(self.reference).eval(), version=-1)
            _warm_up(engine, self.cfg.rollout_batch, min(4, self.max_new))
            self._ready.append(engine)

    def sampler(self, hub: HubClient) -> Sampler:
        """A new worker's sampler, with the latest published weights (called in the
        worker's thread)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        model = copy.deepcopy(self.reference).eval()
        version = self.store.pull(model, -1)
        if self.cfg.engine == "builtin":
            return BuiltinSampler(self, model, version, hub)
        engine: RolloutEngine
        if self.cfg.engine == "vllm":
            engine = self._ready.pop() if self._ready else self._vllm(model, version)
        else:
            engine = TorchRolloutEngine(model, version=version, pad_id=PAD_ID, seed=self.cfg.seed)
            self._engines.append(engine)
        return EngineSampler(self, engine, model, hub)

    def _vllm(self, model: torch.nn.Module, version: int) -> RolloutEngine:
        """A vLLM engine over ``model`` (saved as a Hugging Face folder it reads)."""
        from flowrl.engines.vllm import VLLMRolloutEngine

        folder = tempfile.mkdtemp(prefix="flowrl-policy-")
        self._folders.append(folder)
        model.save_pretrained(folder)  # type: ignore[operator]
        engine = VLLMRolloutEngine(
            folder,
            version=version,
            dtype="float32",
            max_model_len=context_len(self.cfg),
            seed=self.cfg.seed,
        )
        self._engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self._engines:
            engine.close()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
        self._engines.clear()
        self._folders.clear()
        self._ready.clear()


def _warm_up(engine: RolloutEngine, requests: int, max_new: int) -> None:
    """Run ``requests`` short requests through ``engine`` and drop them: its first forward
    passes build its kernels (about 2 s for vLLM on CPU; a GPU engine's start-up does it
    in its profile run). Each request draws from its own seed, so later samples are the
    same with or without it."""
    prompt = np.arange(1, 9, dtype=np.int64)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=0)
    engine.add([GenerationRequest(-1 - i, prompt) for i in range(requests)], params)
    while engine.pending:
        engine.step()


class BuiltinSampler:
    """The KV-cache sampler with durable appends (module docstring)."""

    def __init__(
        self, backend: RolloutBackend, model: torch.nn.Module, version: int, hub: HubClient
    ) -> None:
        self._backend = backend
        self._model = model
        self._lm = as_causal_lm(model)
        self._hub = hub
        self.version = version

    def generate(self, batch: flowrl.Batch) -> ResumableGeneration:
        b, cfg = self._backend, self._backend.cfg
        self.version = b.store.pull(self._model, self.version)  # between micro-batches
        position = b.first_sample + int(batch.indices[0])
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + position)
        with torch.no_grad():
            return generate_resumable(
                self._lm,
                self._hub,
                batch.meta,
                batch.ragged("prompt").tolist(),
                b.max_new,
                version=self.version,
                eos_id=EOS_ID,
                temperature=cfg.temperature,
                generator=gen,
                append_every=cfg.append_every,
            )


class EngineSampler:
    """A rollout engine stepping a micro-batch's requests to the end, durably (module
    docstring). ``model``: a torch copy of the policy (the engine's own for the torch
    engine), to recompute stored log-probs that are missing."""

    def __init__(
        self, backend: RolloutBackend, engine: RolloutEngine, model: torch.nn.Module, hub: HubClient
    ) -> None:
        self._backend = backend
        self.engine = engine
        self._model = model
        self._model_version = engine.version
        self._hub = hub
        self._params = SamplingParams(
            max_new_tokens=backend.max_new,
            temperature=backend.cfg.temperature,
            eos_id=EOS_ID,
            seed=backend.cfg.seed,
        )

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, batch: flowrl.Batch) -> ResumableGeneration:
        b = self._backend
        return generate_durable(
            self.engine,
            self._hub,
            batch.meta,
            batch.ragged("prompt").tolist(),
            self._params,
            ids=[b.first_sample + int(i) for i in batch.indices],
            append_every=b.cfg.append_every,
            policy=self._policy,
            poll_weights=b.store.newer,
        )

    def _policy(self) -> tuple[CausalLM, int]:
        """The torch copy with the newest weights (rarely needed: see ``read_prefixes``).
        The torch engine samples with this very model: ``generate_durable`` loads that
        newest version into the engine right after, so its version catches up before any
        token is sampled."""
        self._model_version = self._backend.store.pull(self._model, self._model_version)
        return as_causal_lm(self._model), self._model_version
