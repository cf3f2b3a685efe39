"""DeepSpeed ZeRO update engine (stages 1, 2, 3), on GPUs with NCCL or on CPUs with gloo.

Every data-parallel rank builds the same model and an engine over it; each trains on its
own micro-batches, and :meth:`~DeepSpeedUpdateEngine.train_step` makes the step the token
mean over every rank's micro-batches (``flowrl.engines._training``). The optimizer is
torch's AdamW handed to DeepSpeed as a client optimizer (no compiled DeepSpeed ops are
needed, so ``pip install deepspeed`` without CUDA is enough); DeepSpeed shards its state
(ZeRO-1), the gradients (ZeRO-2) and the parameters (ZeRO-3). Gradient accumulation is
the caller's: every micro-batch's backward accumulates, ``step`` is the boundary
(``managed_gradient_accumulation: false``). On CPU the collectives are gloo's: the engine
turns off DeepSpeed's shared-memory all-reduce, which would JIT-compile C++ at start.
:meth:`~DeepSpeedUpdateEngine.named_weights` gathers ZeRO-3's sharded parameters, so
every rank yields full tensors.

Process group: the engine joins the default one when it exists; otherwise it creates it
from the usual ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` environment
(torchrun's), or, with none of them set, a one-process group over an in-process store,
and DeepSpeed adopts it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast, final

import torch
import torch.distributed as dist

from flowrl._weights.sync import load_named, module_weights
from flowrl.engines._distributed import init_default_group
from flowrl.engines._training import OptimConfig, TokenWeightedTrainer, missing_state
from flowrl.errors import ConfigError
from flowrl.models.causal import CausalLM, as_causal_lm
from flowrl.models.hf import HFCausalLM

__all__ = ["DeepSpeedUpdateEngine", "checkpoint_globals"]


@final
class DeepSpeedUpdateEngine(TokenWeightedTrainer):
    """ZeRO-``zero_stage`` data-parallel training of ``model`` (module docstring).

    ``config``: DeepSpeed config entries merged over the engine's (e.g. ``bf16``,
    ``zero_optimization`` offload settings); ``backend``: the process-group backend when
    the engine creates it (default: gloo on CPU, nccl with CUDA).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig | None = None,
        *,
        zero_stage: int = 2,
        version: int = 0,
        pad_id: int = 0,
        config: Mapping[str, Any] | None = None,
        backend: str | None = None,
    ) -> None:
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeedUpdateEngine zero_stage expects 0-3, got {zero_stage}")
        try:
            import deepspeed
        except ImportError as exc:
            raise ConfigError(
                "DeepSpeedUpdateEngine needs deepspeed: pip install 'flowrl[deepspeed]' "
                "(in the same pip command as torch, e.g. torch==2.13.0)"
            ) from exc
        self.optim = optim or OptimConfig()
        _init_process_group(backend)
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": self.optim.max_grad_norm or 0.0,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        ds_config.update(config or {})
        self._uses_hf = isinstance(as_causal_lm(model), HFCausalLM)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optim.adamw(model.parameters()), config=ds_config
        )
        self.engine = engine
        self.model = model
        self.zero_stage = zero_stage
        lm: Any = HFCausalLM(engine) if self._uses_hf else engine  # forwards through DeepSpeed
        # DeepSpeed moves the model to its accelerator (the GPU wherever there is one)
        super().__init__(cast(CausalLM, lm), version=version, pad_id=pad_id, device=engine.device)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def _train_mode(self, training: bool) -> None:
        self.engine.train(training)

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def _apply(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self._sum_over_ranks(values)

    @property
    def _grad_scale(self) -> int:
        return dist.get_world_size()  # DeepSpeed averages gradients over ranks

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_stage < 3:
            return module_weights(self.model)
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            full = [(n, t.detach().cpu().clone()) for n, t in module_weights(self.model)]
        return iter(full)

    def state_dict(self) -> dict[str, Any]:
        """Full model weights (gathered), this rank's shard of the optimizer state (under
        ``"optimizer"``, with the rank, world size and ZeRO stage it belongs to), the
        version. Every rank calls it and keeps its own; :meth:`load_state_dict` restores it
        on an engine of the same world size and stage, each rank its own shard."""
        return {
            "model": dict(self.named_weights()),
            "optimizer": {
                "rank": self.rank,
                "world_size": self.world_size,
                "zero_stage": self.zero_stage,
                "shard": self.engine.optimizer.state_dict(),
            },
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s weights, optimizer shard and version; every rank
        calls it with the state it saved. A state that does not fit (another rank's shard,
        another world size or stage, missing entries) raises :class:`ConfigError` on
        every rank before anything is loaded: the ranks agree first, so none is left
        waiting in a collective for one that refused."""
        self._agree(_refusal(state, self.rank, self.world_size, self.zero_stage))
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if self.zero_stage < 3 or self.rank == 0:
                load_named(self.model, state["model"].items())
        optimizer = self.engine.optimizer
        shard = state["optimizer"]["shard"]
        if self.zero_stage == 0:
            optimizer.load_state_dict(shard)
        else:  # ZeRO takes a list indexed by data-parallel rank; each rank reads its own
            optimizer.load_state_dict([shard] * self.world_size, load_from_fp32_weights=False)
        self._version = int(state["version"])

    def _agree(self, refusal: str | None) -> None:
        """Raise on every rank if any rank refuses (its reason on that rank)."""
        refused = int(self._all_sum(torch.tensor([float(refusal is not None)]))[0])
        if refusal is not None:
            raise ConfigError(refusal)
        if refused:
            raise ConfigError(
                f"load_state_dict: {refused} other rank(s) refused their state (see their "
                "error); nothing was loaded"
            )

    def close(self) -> None:
        self.engine.destroy()


def _init_process_group(backend: str | None) -> None:
    if dist.is_initialized():
        return
    import deepspeed

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (a C++ build of
    # minutes) unless its table of compatible ops says no; plain gloo needs no build.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    init_default_group(backend)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # adopts it


def _refusal(state: Mapping[str, Any], rank: int, world_size: int, stage: int) -> str | None:
    """Why this rank cannot load ``state`` (None: it can)."""
    missing = missing_state(state, ("model", "optimizer", "version"))
    if missing is not None:
        return missing
    saved = state["optimizer"]
    keys = ("rank", "world_size", "zero_stage", "shard")
    if not isinstance(saved, Mapping) or any(k not in saved for k in keys):
        return (
            f"load_state_dict on rank {rank}: the optimizer entry is not a DeepSpeedUpdateEngine "
            f"shard (expected the keys {list(keys)}); pass what this engine's state_dict() "
            "returned on this rank"
        )
    if (saved["world_size"], saved["zero_stage"]) != (world_size, stage):
        return (
            f"load_state_dict on rank {rank}: the optimizer state was saved by "
            f"{saved['world_size']} rank(s) under ZeRO-{saved['zero_stage']}, this engine runs "
            f"{world_size} under ZeRO-{stage}; restore it with the same world size and stage"
        )
    if saved["rank"] != rank:
        return (
            f"load_state_dict on rank {rank}: got rank {saved['rank']}'s optimizer shard; "
            "every rank loads the state_dict() it saved itself"
        )
    return None


def checkpoint_globals() -> list[type]:
    """The DeepSpeed classes in :meth:`DeepSpeedUpdateEngine.state_dict`'s optimizer state
    (ZeRO's stage enum, its loss scalers, ZeRO-1/2's fragment addresses): allow them with
    ``torch.serialization.safe_globals`` to read a checkpoint back with
    ``torch.load(weights_only=True)``. Imports deepspeed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
