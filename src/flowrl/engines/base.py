"""The engine protocol: what a rollout stage samples with and what a trainer updates with.

Two small ABCs, one per side of the RL loop, so a pipeline's stages stay the same whatever
runs underneath (the built-in torch model, vLLM, DeepSpeed, Megatron-core, a Hugging Face
model):

- :class:`RolloutEngine` generates **per request, streaming**: requests are added at any
  time, :meth:`~RolloutEngine.step` advances every running request and returns those that
  finished in it, so a rollout stage puts each sample to the hub the moment it is done
  instead of waiting for the slowest of a batch. Every token carries the policy version
  that sampled it. :meth:`~RolloutEngine.update_weights` loads a new version *between
  steps without dropping work*: running requests are interrupted, keep what they
  generated as a prefix, and resume from it under the new weights (partial rollout with
  per-token versions, as AReaL does).
- :class:`UpdateEngine` trains on **packed micro-batches**: recomputes response log-probs
  (:meth:`~UpdateEngine.logprobs`), runs forward/backward over a step's micro-batches and
  one optimizer step with a caller-given loss (:meth:`~UpdateEngine.train_step`), and
  exports its full weights by name (:meth:`~UpdateEngine.named_weights`, gathered when
  sharded) for rollout engines, in this process or another.

Records are frozen dataclasses over numpy arrays and torch tensors (they stay in a process;
what crosses processes is the hub's columns and the weight-sync transport).

Invariants every implementation keeps (the shared conformance tests assert them):

- a :class:`Completion`'s ``tokens``, ``logprobs`` and ``versions`` have one entry per
  response token and start with the request's prefix, unchanged;
- a request is returned by :meth:`~RolloutEngine.step` or :meth:`~RolloutEngine.abort`
  exactly once; :attr:`~RolloutEngine.pending` counts those added and not yet returned;
  :meth:`~RolloutEngine.partial` reads a pending request's tokens so far without
  returning it;
- ``max_new_tokens`` bounds the whole response, prefix included; a response is
  ``finished`` when it ends with ``eos_id`` or reaches ``max_new_tokens``;
- after :meth:`~RolloutEngine.update_weights`, tokens sampled later carry the new version
  and the interrupted requests' earlier tokens keep theirs.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError

if TYPE_CHECKING:  # torch is imported lazily: hub servers import flowrl without it
    import torch

__all__ = [
    "Completion",
    "GenerationRequest",
    "LossFn",
    "RolloutEngine",
    "SamplingParams",
    "TrainBatch",
    "UpdateEngine",
]

_NO_TOKENS = np.empty(0, dtype=np.int64)
_NO_LOGPROBS = np.empty(0, dtype=np.float32)
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads ids over seeds


@final
class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample: ``max_new_tokens`` bounds a whole response (a resumed prefix counts).

    ``temperature`` 0 is greedy; log-probs are ``log_softmax(logits / temperature)`` in
    float32 (of the unscaled logits when greedy), the quantity a trainer recomputes. With
    ``top_p`` < 1 they are renormalised over the nucleus sampled from
    (:func:`flowrl.models.nucleus_logprobs`; ``token_logprobs(..., top_p=)`` recomputes
    them): the behaviour policy's log-probs, which a TIS correction needs.
    ``seed``: a request's random stream is seeded from ``seed``, the request id and its
    prefix length where the engine supports it (reproducible per sample, whatever the batch
    it runs in; a resumed request does not replay the draws it started with).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_id: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(
                f"SamplingParams.max_new_tokens expects an int >= 1, got {self.max_new_tokens!r}"
            )
        if self.temperature < 0:
            raise ConfigError(
                f"SamplingParams.temperature expects >= 0 (0: greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p expects (0, 1], got {self.top_p}")


@final
@dataclass(frozen=True, slots=True, eq=False)
class GenerationRequest:
    """One response to generate. ``id``: the caller's key (a rollout stage uses the hub's
    sample index). ``prefix``: tokens generated earlier for this request (an interrupted
    or preempted generation), with their sampler log-probs and policy versions; the engine
    continues after them and returns them at the head of the :class:`Completion`."""

    id: int
    prompt: NDArray[np.int64]
    prefix: NDArray[np.int64] = field(default_factory=lambda: _NO_TOKENS)
    prefix_logprobs: NDArray[np.float32] = field(default_factory=lambda: _NO_LOGPROBS)
    prefix_versions: NDArray[np.int64] = field(default_factory=lambda: _NO_TOKENS)

    def __post_init__(self) -> None:
        n = len(self.prefix)
        if len(self.prefix_logprobs) != n or len(self.prefix_versions) != n:
            raise ConfigError(
                f"request {self.id}: prefix has {n} tokens but {len(self.prefix_logprobs)} "
                f"log-probs and {len(self.prefix_versions)} versions; pass one of each per token"
            )
        if len(self.prompt) == 0:
            raise ConfigError(f"request {self.id}: the prompt is empty; pass at least one token")

    def seed(self, params_seed: int | None) -> int | None:
        """This request's own random seed under ``SamplingParams.seed`` (``None``: none):
        mixed from it, the id and the prefix length, so a sample does not depend on the
        batch it runs in and a resumed request draws anew instead of replaying its start."""
        if params_seed is None:
            return None
        return (params_seed * _SEED_MIX + self.id * 1_000_003 + len(self.prefix)) % 2**63


@final
@dataclass(frozen=True, slots=True, eq=False)
class Completion:
    """A request's response so far: the whole of it when ``finished``, else the prefix an
    interrupted request resumes from (:meth:`resume`). One entry per response token in
    ``tokens`` (int64), ``logprobs`` (float32, the sampler's) and ``versions`` (int64)."""

    id: int
    tokens: NDArray[np.int64]
    logprobs: NDArray[np.float32]
    versions: NDArray[np.int64]
    finished: bool

    def resume(self, prompt: NDArray[np.int64]) -> GenerationRequest:
        """The request that continues this response after ``prompt``."""
        return GenerationRequest(self.id, prompt, self.tokens, self.logprobs, self.versions)


class RolloutEngine(abc.ABC):
    """Streaming generation (module docstring). Not thread-safe: one driver thread calls it.

    Subclasses implement :meth:`add`, :meth:`step`, :meth:`abort`, :meth:`partial`,
    :meth:`pending` and :meth:`load_weights`; :meth:`update_weights` is built on them.
    """

    def __init__(self, *, version: int = 0) -> None:
        self._version = version
        self._prompts: dict[int, NDArray[np.int64]] = {}
        self._params: dict[int, SamplingParams] = {}

    @property
    def version(self) -> int:
        """The policy version of the weights new tokens are sampled with."""
        return self._version

    @property
    @abc.abstractmethod
    def pending(self) -> int:
        """Requests added and not yet returned by :meth:`step` or :meth:`abort`."""

    @abc.abstractmethod
    def add(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Queue requests; they start at the next :meth:`step`. Ids must not be pending."""

    @abc.abstractmethod
    def step(self) -> list[Completion]:
        """Advance every running request (one decoding step, or one scheduler step of the
        engine); returns the requests that finished in it, ``finished=True``."""

    @abc.abstractmethod
    def abort(self, ids: Iterable[int] | None = None) -> list[Completion]:
        """Stop the given requests (all pending when ``None``) and return what each has:
        ``finished=False`` unless it had already finished. Unknown ids are ignored."""

    @abc.abstractmethod
    def partial(self, ids: Iterable[int] | None = None) -> list[Completion]:
        """What the given pending requests (all when ``None``) have generated so far, prefix
        included, ``finished=False``, without stopping them: what a durable rollout
        appends to the hub as it streams. Unknown ids are ignored."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load named tensors (the update engine's names) into the sampling model, with no
        request running. Called by :meth:`update_weights`."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load ``version``'s weights between steps without dropping work: running requests
        are interrupted and resumed from what they generated, their next tokens tagged with
        ``version``. Returns how many requests were resumed."""
        prompts, params_of = dict(self._prompts), dict(self._params)  # abort forgets them
        interrupted = self.abort()
        self.load_weights(weights)
        self._version = version
        by_params: dict[SamplingParams, list[GenerationRequest]] = {}
        for done in interrupted:
            by_params.setdefault(params_of[done.id], []).append(done.resume(prompts[done.id]))
        for params, requests in by_params.items():
            self.add(requests, params)
        return len(interrupted)

    def _remember(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Subclasses call this from :meth:`add`: what :meth:`update_weights` resumes from."""
        for r in requests:
            self._prompts[r.id] = r.prompt
            self._params[r.id] = params

    def _forget(self, ids: Iterable[int]) -> None:
        """Subclasses call this for every request they return."""
        for i in ids:
            self._prompts.pop(i, None)
            self._params.pop(i, None)

    def close(self) -> None:  # noqa: B027 (engines without resources need nothing)
        """Release the engine's resources (processes, GPU memory)."""


@final
@dataclass(frozen=True, slots=True, eq=False)
class TrainBatch:
    """A packed micro-batch of ``prompt + response`` sequences for a forward pass.

    ``prompts`` and ``responses`` are ragged int64 token ids, packed, with
    ``prompt_cu`` / ``response_cu`` int64 offsets (``B + 1``). Per-response-token
    float32 tensors share ``response_cu``: ``old_logprobs`` (the proximal policy's,
    recomputed), ``ref_logprobs`` (the frozen reference's, for a KL penalty) and
    ``sample_logprobs`` (the sampler's, for a behaviour-policy correction). ``advantages``
    is float32 per sample. What a loss does not use may be ``None``.
    """

    prompts: torch.Tensor
    prompt_cu: torch.Tensor
    responses: torch.Tensor
    response_cu: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sample_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.response_cu.numel()) - 1

    @property
    def n_tokens(self) -> int:
        """Response tokens: what a loss is averaged over."""
        return int(self.response_cu[-1] - self.response_cu[0])

    @classmethod
    def pack(
        cls,
        prompts: Sequence[Any],
        responses: Sequence[Any],
        *,
        advantages: Any = None,
        old_logprobs: Sequence[Any] | None = None,
        ref_logprobs: Sequence[Any] | None = None,
        sample_logprobs: Sequence[Any] | None = None,
    ) -> TrainBatch:
        """Pack per-sample sequences (lists, numpy arrays or tensors): token ids int64,
        per-token log-probs float32 (one per response token), ``advantages`` one float per
        sample."""
        import torch

        if len(prompts) != len(responses):
            raise ConfigError(
                f"TrainBatch.pack got {len(prompts)} prompts and {len(responses)} responses; "
                "pass one response per prompt"
            )

        def packed(rows: Sequence[Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            flat = [torch.as_tensor(r, dtype=dtype).reshape(-1) for r in rows]
            cu = torch.zeros(len(flat) + 1, dtype=torch.long)
            torch.cumsum(torch.tensor([r.numel() for r in flat], dtype=torch.long), 0, out=cu[1:])
            return (torch.cat(flat) if flat else torch.empty(0, dtype=dtype)), cu

        p, p_cu = packed(prompts, torch.long)
        r, r_cu = packed(responses, torch.long)
        if bool((p_cu.diff() < 1).any()):
            raise ConfigError("TrainBatch.pack: every prompt needs at least one token")

        def per_token(name: str, rows: Sequence[Any] | None) -> torch.Tensor | None:
            if rows is None:
                return None
            values, cu = packed(rows, torch.float32)
            if not torch.equal(cu, r_cu):
                raise ConfigError(
                    f"TrainBatch.pack: {name} must have one value per response token "
                    f"(lengths {r_cu.diff().tolist()}), got lengths {cu.diff().tolist()}"
                )
            return values

        adv = None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
        if adv is not None and adv.shape != (len(prompts),):
            raise ConfigError(
                f"TrainBatch.pack: advantages expects one float per sample ({len(prompts)}), "
                f"got shape {tuple(adv.shape)}"
            )
        return cls(
            p,
            p_cu,
            r,
            r_cu,
            advantages=adv,
            old_logprobs=per_token("old_logprobs", old_logprobs),
            ref_logprobs=per_token("ref_logprobs", ref_logprobs),
            sample_logprobs=per_token("sample_logprobs", sample_logprobs),
        )

    def split(self, n: int) -> list[TrainBatch]:
        """``n`` micro-batches of consecutive samples, as even in count as possible (some
        empty when ``n`` exceeds the samples)."""
        if n < 1:
            raise ConfigError(f"TrainBatch.split expects n >= 1, got {n}")
        bounds = np.linspace(0, len(self), n + 1).round().astype(int)
        return [self._rows(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def _rows(self, a: int, b: int) -> TrainBatch:
        p0, p1 = int(self.prompt_cu[a]), int(self.prompt_cu[b])
        r0, r1 = int(self.response_cu[a]), int(self.response_cu[b])

        def tok(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[r0:r1]

        return TrainBatch(
            self.prompts[p0:p1],
            self.prompt_cu[a : b + 1] - p0,
            self.responses[r0:r1],
            self.response_cu[a : b + 1] - r0,
            advantages=None if self.advantages is None else self.advantages[a:b],
            old_logprobs=tok(self.old_logprobs),
            ref_logprobs=tok(self.ref_logprobs),
            sample_logprobs=tok(self.sample_logprobs),
        )

    def model_inputs(
        self, pad_id: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``(input_ids, attention_mask, response_starts, response_cu)`` of
        ``prompt + response`` rows, as :func:`flowrl.rl.token_logprobs` takes them."""
        from flowrl.rl.grpo import build_batch

        prompts = _split_rows(self.prompts, self.prompt_cu)
        responses = _split_rows(self.responses, self.response_cu)
        return build_batch(prompts, responses, pad_id=pad_id)


def _split_rows(values: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    """Rows of a packed tensor."""
    return list(values.split(cu.diff().tolist()))


#: ``loss_fn(logprobs, batch) -> (loss, metrics)``: ``logprobs`` are the current weights'
#: float32 log-probs of ``batch``'s response tokens (packed by ``response_cu``), with
#: gradients; the loss is a scalar to minimise, *averaged over this micro-batch's response
#: tokens* (a token mean, as ``flowrl.rl.grpo_loss`` computes it). ``train_step`` weights
#: each micro-batch by its share of the step's response tokens (over every data-parallel
#: rank), so the step minimises the token mean of the whole step, however it is split.
LossFn = Callable[["torch.Tensor", TrainBatch], "tuple[torch.Tensor, Mapping[str, float]]"]


class UpdateEngine(abc.ABC):
    """Trains the policy on packed micro-batches (module docstring)."""

    def __init__(self, *, version: int = 0) -> None:
        self._version = version

    @property
    def version(self) -> int:
        """Optimizer steps taken (plus the start version): the version of the weights."""
        return self._version

    @abc.abstractmethod
    def logprobs(self, batch: TrainBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Float32 log-probs of ``batch``'s response tokens under the current weights, no
        gradients (logprob recompute)."""

    @abc.abstractmethod
    def train_step(self, micro_batches: Sequence[TrainBatch], loss_fn: LossFn) -> dict[str, float]:
        """Forward and backward over every micro-batch, one optimizer step; the version
        advances by one. Each micro-batch's loss is weighted by its share of the step's
        response tokens (:data:`LossFn`). Returns the loss functions' metrics averaged over
        micro-batches with the same weights, with ``loss`` (the step's token-mean loss) and
        ``grad_norm`` (before clipping)."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights by name (gathered when sharded), on the CPU, for rollout
        engines: every rank may call it, only rank 0's tensors are complete."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state, for a checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""

    def close(self) -> None:  # noqa: B027 (engines without resources need nothing)
        """Release the engine's resources (process groups, GPU memory)."""
