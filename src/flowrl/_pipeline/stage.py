"""``@stage``: turn a function or a class into a frozen, validated :class:`StageSpec`.

A *consuming* stage names its ``inputs``; it is called with one :class:`~flowrl.Batch`
(a micro-batch of ``batch_size`` samples whose inputs are ready) and returns its
``outputs`` for exactly those samples: a ``dict`` of column name to values, or
:class:`Rows` to also set versions or drop samples (``keep=``). A stage without outputs
is a sink and returns ``None``.

A *source* stage has no inputs and creates samples: ``fn()`` returns a dict (or
:class:`Rows`) of at most ``batch_size`` new samples per call, and ``None`` (or raises
``StopIteration``) once exhausted; a generator function yields them instead.

A class works for stateful stages (models): it is instantiated once per worker with no
arguments, ``setup(self)`` or ``setup(self, ctx)`` runs once in the worker before its first
batch (``ctx`` is a :class:`StageContext`), and ``__call__`` takes the place of ``fn``.

Everything is checked once, at decoration; errors name the stage and the file and line of
the decoration, and end with a hint.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, final

import msgspec

from flowrl._controller.samplers import BalancedSampler, Sampler
from flowrl._schema.columns import Column
from flowrl.errors import ConfigError, PipelineError

__all__ = ["Rows", "StageContext", "StageSpec", "stage"]


@final
class StageSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A validated stage: what it reads and writes, how it is batched, where it was declared.

    ``fn`` is the decorated function or class. ``output_columns`` are the outputs that
    were declared with a type (``Column``) rather than by name. ``file``/``line`` locate
    the decoration for error messages.
    """

    name: str
    fn: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    output_columns: tuple[Column, ...]
    batch_size: int
    workers: int
    sampler: Sampler | None
    min_batch: int | None
    lease_timeout: float | None
    is_class: bool
    is_generator: bool
    setup_takes_context: bool
    file: str
    line: int
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    placement_strategy: str | None = None
    prefetch: int = 1

    @property
    def is_source(self) -> bool:
        return not self.inputs

    @property
    def where(self) -> str:
        return f"stage {self.name!r} ({self.file}:{self.line})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by reference (module and name) where the spec is importable, as functions
        are: ``@stage`` replaced the function under its name, so pickling ``fn`` itself would
        fail. Worker processes import the spec instead."""
        module = getattr(self.fn, "__module__", None)
        qualname = getattr(self.fn, "__qualname__", "")
        if module is not None and "<" not in qualname and _lookup(module, qualname) is self:
            return (_lookup, (module, qualname))
        return cast(tuple[Any, ...], super().__reduce__())

    def __repr__(self) -> str:
        return (
            f"StageSpec({self.name!r}, inputs={list(self.inputs)}, "
            f"outputs={list(self.outputs)}, batch_size={self.batch_size}, "
            f"workers={self.workers})"
        )


def _lookup(module: str, qualname: str) -> object:
    """The object named ``qualname`` in ``module`` (None if there is none)."""
    obj: object = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


@final
class Rows(msgspec.Struct, frozen=True):
    """What a stage returns when a plain dict of columns is not enough.

    ``data``: output column name to values. ``groups`` (GRPO group ids: one int, or one
    per sample), ``partition`` (sources only), ``version`` (the policy version that produced
    the data: one int, or one per sample) and ``tokens`` (per-sample token counts) are
    passed on to ``hub.put``.
    ``keep`` (consuming stages only) is a boolean mask over the batch: ``data`` then holds
    values for the kept samples only, and the dropped samples never reach the stages that
    consume this stage's outputs.
    """

    data: Mapping[str, Any]
    groups: Any = None
    partition: str = ""
    version: Any = None
    tokens: Any = None
    keep: Any = None


@final
class StageContext(msgspec.Struct, frozen=True, kw_only=True):
    """Passed to ``setup(self, ctx)`` of a class stage: which worker this is, and its hub."""

    stage: str
    worker: int
    workers: int
    hub: Any


def stage(
    fn: object = None,
    /,
    *,
    inputs: Sequence[str] = (),
    outputs: Sequence[str | Column] = (),
    batch_size: int | None = None,
    name: str | None = None,
    workers: int = 1,
    sampler: Sampler | None = None,
    min_batch: int | None = None,
    lease_timeout: float | None = None,
    prefetch: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    placement_strategy: str | None = None,
) -> Callable[[object], StageSpec]:
    """Declare a stage. Use as ``@flowrl.stage(inputs=[...], outputs=[...], batch_size=n)``.

    ``batch_size``: samples per call (for a source: the most it returns per call).
    ``workers``: concurrent calls (threads, processes or Ray actors, per executor).
    ``sampler``: which ready samples a claim takes (e.g. ``GroupSampler`` for whole GRPO
    groups; a ``BalancedSampler(dp_size=workers)`` makes worker ``r`` data-parallel rank
    ``r``). ``min_batch``: run on fewer than ``batch_size`` samples once this many are ready.
    ``lease_timeout``: seconds one call may take before its samples go back to the hub.
    ``prefetch``: a worker in another process than the hub's controller holds this many
    micro-batches claimed and read ahead (claimed in one request) and this many outputs
    in flight; raise it (e.g. 8) for small micro-batches whose round trips take longer
    than their compute. Batches held ahead are leased: other workers cannot take them.

    Resources of one worker, used by ``executor="ray"`` (the other executors run where
    they are): ``num_cpus`` (default 1) and ``num_gpus`` (fractions share a device).
    ``placement_strategy`` (``"STRICT_PACK"``, ``"PACK"``, ``"SPREAD"`` or
    ``"STRICT_SPREAD"``): reserve a Ray placement group of ``num_gpus`` one-GPU bundles per
    worker; the worker runs in the first bundle and the Ray tasks and actors it starts
    (e.g. an engine's tensor-parallel ranks) go to the others. Without it, a worker gets
    all its ``num_gpus`` in its own process, on one node.
    """
    caller = sys._getframe(1)
    if fn is not None:
        raise ConfigError(
            f"@stage at {caller.f_code.co_filename}:{caller.f_lineno} was used without "
            "arguments; write @flowrl.stage(inputs=[...], outputs=[...], batch_size=n)"
        )

    def decorate(obj: object) -> StageSpec:
        frame = sys._getframe(1)
        loc = _Where(name, obj, frame.f_code.co_filename, frame.f_lineno)
        ins = cast(list[str], _names(inputs, "inputs", loc, allow_columns=False))
        outs = _names(outputs, "outputs", loc, allow_columns=True)
        _check_columns(ins, [c.name if isinstance(c, Column) else c for c in outs], loc)
        is_class, is_gen, setup_ctx = _check_callable(obj, bool(ins), loc)
        size = _check_numbers(batch_size, workers, min_batch, lease_timeout, bool(ins), loc)
        _check_prefetch(prefetch, bool(ins), loc)
        _check_sampler(sampler, workers, bool(ins), loc)
        _check_resources(num_cpus, num_gpus, placement_strategy, loc)
        if is_gen and workers != 1:
            raise loc.config(
                f"a generator source runs in one worker, got workers={workers}",
                "drop workers=, or write a plain function returning one batch per call",
            )
        if not ins and not outs:
            raise loc.pipeline(
                "a source stage (no inputs) must declare outputs",
                "add outputs=[...] with the columns it creates",
            )
        return StageSpec(
            name=loc.name,
            fn=obj,
            inputs=tuple(ins),
            outputs=tuple(c.name if isinstance(c, Column) else c for c in outs),
            output_columns=tuple(c for c in outs if isinstance(c, Column)),
            batch_size=size,
            workers=workers,
            sampler=sampler,
            min_batch=min_batch,
            lease_timeout=lease_timeout,
            is_class=is_class,
            is_generator=is_gen,
            setup_takes_context=setup_ctx,
            file=loc.file,
            line=loc.line,
            num_cpus=float(num_cpus),
            num_gpus=float(num_gpus),
            placement_strategy=placement_strategy,
            prefetch=prefetch,
        )

    return decorate


class _Where:
    """The stage being declared and where, to build error messages."""

    def __init__(self, name: str | None, obj: object, file: str, line: int) -> None:
        self.file = file
        self.line = line
        given = name if name is not None else getattr(obj, "__name__", None)
        if not isinstance(given, str) or not given.isidentifier():
            shown = given if given is not None else type(obj).__name__
            raise ConfigError(
                f"stage {shown!r} at {file}:{line}: a stage name must be a Python identifier "
                f"(it names the stage's hub task); pass name='my_stage'"
            )
        self.name = given

    def _text(self, what: str, hint: str) -> str:
        return f"stage {self.name!r} at {self.file}:{self.line}: {what}; {hint}"

    def config(self, what: str, hint: str) -> ConfigError:
        return ConfigError(self._text(what, hint))

    def pipeline(self, what: str, hint: str) -> PipelineError:
        return PipelineError(self._text(what, hint))


def _names(values: object, what: str, loc: _Where, *, allow_columns: bool) -> list[str | Column]:
    if isinstance(values, str | Column) or not isinstance(values, Sequence):
        raise loc.pipeline(
            f"{what} must be a list of column names, got {values!r}",
            f"write {what}=[{values!r}]" if isinstance(values, str) else f"pass {what}=[...]",
        )
    out: list[str | Column] = []
    for v in values:
        if (isinstance(v, Column) and allow_columns) or (isinstance(v, str) and v.isidentifier()):
            out.append(v)
        else:
            kinds = "a column name or a flowrl.Column" if allow_columns else "a column name"
            raise loc.pipeline(
                f"{what} entry {v!r} is not {kinds}",
                "column names are Python identifiers, like 'reward'",
            )
    return out


def _check_columns(inputs: list[Any], outputs: list[str], loc: _Where) -> None:
    for what, names in (("inputs", inputs), ("outputs", outputs)):
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise loc.pipeline(f"{what} name {dupes} more than once", "list each column once")
    both = sorted(set(inputs) & set(outputs))
    if both:
        raise loc.pipeline(
            f"columns {both} are both inputs and outputs; a stage may not overwrite what it reads",
            f"write a new column instead, e.g. outputs=['{both[0]}_v2']",
        )


def _check_numbers(
    batch_size: object,
    workers: object,
    min_batch: object,
    lease_timeout: object,
    consumes: bool,
    loc: _Where,
) -> int:
    """Check the numeric options; returns the batch size."""
    if batch_size is None:
        raise loc.config(
            "batch_size is missing",
            "pass batch_size=n (samples per call; for a source, the most it returns per call)",
        )
    if not _positive_int(batch_size):
        raise loc.config(f"batch_size must be a positive int, got {batch_size!r}", "use e.g. 8")
    if not _positive_int(workers):
        raise loc.config(f"workers must be a positive int, got {workers!r}", "use e.g. 2")
    if min_batch is not None:
        if not consumes:
            raise loc.config("min_batch applies to consuming stages only", "drop min_batch=")
        if not _positive_int(min_batch) or min_batch > batch_size:  # type: ignore[operator]
            raise loc.config(
                f"min_batch must be an int in [1, batch_size={batch_size}], got {min_batch!r}",
                "use min_batch=1 to run on whatever is ready",
            )
    if lease_timeout is not None and (
        not isinstance(lease_timeout, int | float)
        or isinstance(lease_timeout, bool)
        or not lease_timeout > 0
    ):
        raise loc.config(
            f"lease_timeout must be a positive number of seconds, got {lease_timeout!r}",
            "set it above the longest time one call may take",
        )
    return batch_size  # type: ignore[return-value]


def _check_prefetch(prefetch: object, consumes: bool, loc: _Where) -> None:
    if not _positive_int(prefetch):
        raise loc.config(f"prefetch must be a positive int, got {prefetch!r}", "use e.g. 4")
    if prefetch != 1 and not consumes:
        raise loc.config("prefetch applies to consuming stages only", "drop prefetch=")


def _check_sampler(sampler: object, workers: object, consumes: bool, loc: _Where) -> None:
    if sampler is None:
        return
    if not consumes:
        raise loc.config("a source stage claims nothing, so it takes no sampler", "drop sampler=")
    if not isinstance(sampler, Sampler):
        raise loc.config(
            f"sampler must be a flowrl Sampler, got {sampler!r}",
            "use e.g. flowrl.GroupSampler(group_size)",
        )
    if isinstance(sampler, BalancedSampler) and sampler.dp_size != workers:
        raise loc.config(
            f"BalancedSampler(dp_size={sampler.dp_size}) needs one worker per data-parallel "
            f"rank, got workers={workers}",
            f"pass workers={sampler.dp_size}",
        )


_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def _check_resources(num_cpus: float, num_gpus: float, strategy: str | None, loc: _Where) -> None:
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not 0 <= value < float("inf")
        ):
            raise loc.config(
                f"{name} must be a number >= 0 (per worker), got {value!r}", f"use e.g. {name}=1"
            )
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise loc.config(
            f"num_gpus above 1 must be a whole number of devices, got {num_gpus!r}",
            "use a fraction below 1 to share one GPU, or a whole number",
        )
    if strategy is None:
        return
    if strategy not in _PLACEMENT_STRATEGIES:
        raise loc.config(
            f"placement_strategy must be one of {list(_PLACEMENT_STRATEGIES)}, got {strategy!r}",
            "use 'STRICT_PACK' to keep a worker's GPUs on one node",
        )
    if num_gpus < 1:
        raise loc.config(
            f"placement_strategy reserves one bundle per GPU, but num_gpus={num_gpus!r}",
            "pass num_gpus=n (a whole number >= 1) with it, or drop placement_strategy",
        )


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _check_callable(obj: object, consumes: bool, loc: _Where) -> tuple[bool, bool, bool]:
    """Check how the executor will call ``obj``; returns (is_class, is_generator, setup_ctx)."""
    call_as = "fn(batch)" if consumes else "fn()"
    if inspect.isclass(obj):
        init = _signature(obj, loc, "the class")
        if not _binds(init):
            raise loc.pipeline(
                f"class {obj.__name__} cannot be instantiated without arguments {init}",
                "give every __init__ parameter a default, and load models in setup(self)",
            )
        if not any("__call__" in vars(k) for k in obj.__mro__[:-1]):
            raise loc.pipeline(
                f"class {obj.__name__} has no __call__ method",
                f"define __call__(self{', batch' if consumes else ''})",
            )
        call = obj.__call__  # type: ignore[operator]
        _check_call(call, consumes, loc, f"{obj.__name__}.__call__", self_arg=True)
        setup = getattr(obj, "setup", None)
        setup_ctx = False
        if setup is not None:
            sig = _signature(setup, loc, f"{obj.__name__}.setup")
            if _binds(sig, None):
                setup_ctx = False
            elif _binds(sig, None, None):
                setup_ctx = True
            else:
                raise loc.pipeline(
                    f"{obj.__name__}.setup{sig} must take (self) or (self, ctx)",
                    "write def setup(self) or def setup(self, ctx)",
                )
        return True, inspect.isgeneratorfunction(call), setup_ctx
    if not callable(obj):
        raise loc.pipeline(
            f"@stage decorates a function or a class, got {type(obj).__name__}",
            f"decorate a function called as {call_as}",
        )
    _check_call(obj, consumes, loc, getattr(obj, "__name__", "fn"), self_arg=False)
    return False, inspect.isgeneratorfunction(obj), False


def _check_call(fn: Any, consumes: bool, loc: _Where, label: str, *, self_arg: bool) -> None:
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise loc.pipeline(f"{label} is async; stages are synchronous", "use a plain def")
    sig = _signature(fn, loc, label)
    args = (None,) * (int(self_arg) + int(consumes))
    if not _binds(sig, *args):
        if consumes:
            raise loc.pipeline(
                f"{label}{sig} must take exactly one batch argument (it consumes inputs)",
                f"write def {label.rsplit('.', 1)[-1]}({'self, ' if self_arg else ''}batch)",
            )
        raise loc.pipeline(
            f"{label}{sig} must take no arguments: a stage without inputs is a source",
            "add inputs=[...] to consume columns, or drop the parameters",
        )
    if consumes and inspect.isgeneratorfunction(fn):
        raise loc.pipeline(
            f"{label} is a generator, but a consuming stage returns one result per batch",
            "return a dict of output columns instead of yielding",
        )


def _signature(fn: Any, loc: _Where, label: str) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        raise loc.pipeline(
            f"cannot read the signature of {label}", "decorate a Python function or class"
        ) from None


def _binds(sig: inspect.Signature, *args: object) -> bool:
    try:
        sig.bind(*args)
    except TypeError:
        return False
    return True
