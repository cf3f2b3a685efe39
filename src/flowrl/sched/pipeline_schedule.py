"""Fused bidirectional pipeline schedules (RLHFuse §5): the problem, its bound, validation.

Two (or more) models are trained on the same ``N`` GPU stages, each split into pipelines of
``stages`` stages (the paper's fusion factor ``K = N / stages`` pipelines per model, each on
its own block of GPU stages), each pipeline processing ``microbatches`` micro-batches. A model
with ``reverse=True`` runs its pipelines from GPU stage ``N-1`` down to ``0``, so its bubbles
fall where the forward model is busy and vice versa (Chimera's bidirectional pipeline,
generalised to models of different depth and size). Stages are in units of equal GPU groups:
when the two models' tensor-parallel sizes differ by ``s``, merge every ``s`` stages of the
model with the smaller TP first (the paper's problem transformation).

Every GPU stage runs the forward (``F``) and backward (``B``) of every micro-batch of every
pipeline that crosses it: ``2 * sum_k microbatches_k`` ops, the rows of the paper's schedule
matrix ``S``. A schedule is each GPU stage's op *order*; its times follow (the paper's
ComputeEnergy): an op starts when the previous op on its GPU stage and its data predecessor
(``F`` of the previous stage, ``B`` of the next stage, or for the last stage's ``B`` its own
``F``) have both finished. A stage holds ``activation`` for each micro-batch whose ``F`` ran
and whose ``B`` has not; its peak over the order must stay within ``memory_limit``.

- :func:`lower_bound` — the paper's bound (each model's own critical path, and per GPU
  stage the earliest arrival of its first op + all its work + the shortest remaining chain
  after its last op, maximised over stages) or, by default, a tighter one: each stage as a
  preemptive one-machine problem with every op's own head and tail, solved exactly by
  Jackson's rule. Neither is always reachable.
- :func:`one_f_one_b` / :func:`serial_1f1b` — each model alone with 1F1B, and the models one
  after the other (the paper's baseline, and its memory lower bound);
  :func:`one_f_one_b_streams` / :func:`serial_order` — the op orders they are built from.
- :func:`longest_paths` — the times of an op order (the search's inner loop).
- :func:`timed` — times, peaks and makespan of an order (``ConfigError`` on a deadlock).
- :func:`validate_schedule` — checks a :class:`FusedSchedule` independently of how it was
  made: every op exactly once on its GPU stage, durations, data dependencies, one op at a
  time per stage, memory within the limit, reported makespan and peaks.
- :class:`FusedSchedule` — the JSON schedule file (``to_json`` / ``FusedSchedule.from_json``).

Invariants (asserted by tests): every schedule :func:`timed` returns passes
:func:`validate_schedule`; its makespan is ``>= lower_bound``, and the Jackson bound is
``>=`` the paper's; :func:`one_f_one_b` matches ``(M + P - 1) * (f + b)`` and peaks at
``min(P - s, M)`` activations on local stage ``s``.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, final

import msgspec

from flowrl.errors import ConfigError

__all__ = [
    "SCHEDULE_FORMAT",
    "FusedProblem",
    "FusedSchedule",
    "PipelineModel",
    "ScheduledOp",
    "longest_paths",
    "lower_bound",
    "one_f_one_b",
    "one_f_one_b_streams",
    "serial_1f1b",
    "serial_order",
    "timed",
    "validate_schedule",
]

SCHEDULE_FORMAT = "flowrl.fused-schedule/1"
_EPS = 1e-9


@final
class PipelineModel(msgspec.Struct, frozen=True, kw_only=True):
    """One model's pipelines: ``stages`` per pipeline, per-micro-batch costs per stage."""

    name: str
    stages: int
    microbatches: int
    forward_s: float
    backward_s: float
    activation: float = 1.0
    reverse: bool = False

    def __post_init__(self) -> None:
        if self.stages < 1 or self.microbatches < 1:
            raise ConfigError(
                f"PipelineModel {self.name!r} needs stages >= 1 and microbatches >= 1, "
                f"got stages={self.stages}, microbatches={self.microbatches}"
            )
        if not (self.forward_s > 0 and self.backward_s > 0 and self.activation >= 0):
            raise ConfigError(
                f"PipelineModel {self.name!r} needs forward_s > 0, backward_s > 0 and "
                f"activation >= 0, got {self.forward_s}, {self.backward_s}, {self.activation}"
            )


@final
class FusedProblem(msgspec.Struct, frozen=True, kw_only=True):
    """``gpu_stages`` GPU stages shared by ``models``; ``memory_limit`` per stage (None: none)."""

    gpu_stages: int
    models: tuple[PipelineModel, ...]
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("FusedProblem.models must name at least one model")
        for m in self.models:
            if self.gpu_stages < m.stages or self.gpu_stages % m.stages:
                raise ConfigError(
                    f"FusedProblem.gpu_stages={self.gpu_stages} must be a multiple of model "
                    f"{m.name!r}'s stages={m.stages} (the fusion factor K = gpu_stages/stages); "
                    "merge stages of the model with the smaller TP first"
                )
        need = max(m.activation for m in self.models)
        if self.memory_limit is not None and self.memory_limit < need:
            raise ConfigError(
                f"FusedProblem.memory_limit={self.memory_limit} is below one micro-batch's "
                f"activation ({need}); no schedule fits, raise the limit"
            )

    def pipelines(self, model: int) -> int:
        """The fusion factor ``K`` of ``models[model]``."""
        return self.gpu_stages // self.models[model].stages


@final
class ScheduledOp(msgspec.Struct, frozen=True, array_like=True):
    """One op in a schedule file: ``[model, pipeline, microbatch, stage, phase, start, end]``
    (``stage`` is the pipeline-local stage, ``phase`` ``"F"`` or ``"B"``)."""

    model: int
    pipeline: int
    microbatch: int
    stage: int
    phase: Literal["F", "B"]
    start: float
    end: float


@final
class FusedSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """A fused schedule: per GPU stage, its ops in execution order, with their times."""

    problem: FusedProblem
    gpus: tuple[tuple[ScheduledOp, ...], ...]
    makespan: float
    lower_bound: float
    peak_memory: tuple[float, ...]
    method: str = ""
    format: str = SCHEDULE_FORMAT

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def from_json(data: bytes | str) -> FusedSchedule:
        """Decode a schedule file and validate it (``ConfigError`` naming what is wrong)."""
        try:
            sched = msgspec.json.decode(data, type=FusedSchedule)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ConfigError(f"not a fused schedule file ({SCHEDULE_FORMAT}): {exc}") from exc
        if sched.format != SCHEDULE_FORMAT:
            raise ConfigError(
                f"schedule file format {sched.format!r} is not {SCHEDULE_FORMAT!r}; "
                "regenerate it with this flowrl version"
            )
        validate_schedule(sched)
        return sched


# --------------------------------------------------------------------------- op layout


@final
@dataclass(frozen=True, slots=True)
class Layout:
    """Ops of a problem, numbered; plain lists because the search loops over them in Python.

    Op ``i``: ``key[i] = (model, pipeline, microbatch, stage, phase)`` (phase 0 F, 1 B) runs on
    GPU stage ``gpu[i]`` for ``dur[i]``; ``pred[i]`` is its data predecessor (-1: none),
    ``succ[i]`` its data successor; ``mem[i]`` the activation it adds (F) or frees (B);
    ``tail[i]`` the longest chain of its pipeline after it ends.
    """

    n: int
    key: list[tuple[int, int, int, int, int]]
    gpu: list[int]
    dur: list[float]
    pred: list[int]
    succ: list[int]
    mem: list[float]
    tail: list[float]
    index: dict[tuple[int, int, int, int, int], int]


@functools.lru_cache(maxsize=32)
def layout(problem: FusedProblem) -> Layout:
    keys: list[tuple[int, int, int, int, int]] = []
    gpu: list[int] = []
    dur: list[float] = []
    mem: list[float] = []
    tail: list[float] = []
    n_stages = problem.gpu_stages
    for k, m in enumerate(problem.models):
        for p in range(problem.pipelines(k)):
            for mb in range(m.microbatches):
                for s in range(m.stages):
                    g = p * m.stages + s
                    g = n_stages - 1 - g if m.reverse else g
                    for phase in (0, 1):
                        keys.append((k, p, mb, s, phase))
                        gpu.append(g)
                        dur.append(m.forward_s if phase == 0 else m.backward_s)
                        mem.append(m.activation if phase == 0 else -m.activation)
                        after_f = (m.stages - 1 - s) * m.forward_s + m.stages * m.backward_s
                        tail.append(after_f if phase == 0 else s * m.backward_s)
    index = {key: i for i, key in enumerate(keys)}
    pred = [-1] * len(keys)
    succ = [-1] * len(keys)
    for i, (k, p, mb, s, phase) in enumerate(keys):
        last = problem.models[k].stages - 1
        if phase == 0 and s > 0:
            j = index[(k, p, mb, s - 1, 0)]
        elif phase == 1:
            j = index[(k, p, mb, s, 0)] if s == last else index[(k, p, mb, s + 1, 1)]
        else:
            continue
        pred[i] = j
        succ[j] = i
    return Layout(len(keys), keys, gpu, dur, pred, succ, mem, tail, index)


Order = list[list[int]]


def longest_paths(
    seqs: Sequence[Sequence[int]],
    dep: Sequence[int],
    dur: Sequence[float],
    release: Sequence[float] | None = None,
) -> list[float] | None:
    """Finish time of every op when each sequence runs its ops in order and an op also waits
    for ``dep[op]`` (-1: nothing) — the longest path through the schedule's graph, in
    O(ops): a sequence runs until its next op waits on an unfinished one, and resumes when
    that one finishes. None when some op is never reached (a cycle: a deadlock)."""
    n = len(dep)
    finish = [-1.0] * n
    waiter = [-1] * n
    ptr = [0] * len(seqs)
    clock = [0.0] * len(seqs)
    lengths = [len(seq) for seq in seqs]
    work = list(range(len(seqs)))
    wake = work.append
    done = 0
    while work:
        g = work.pop()
        seq = seqs[g]
        p0 = p = ptr[g]
        end = lengths[g]
        t = clock[g]
        while p < end:
            op = seq[p]
            d = dep[op]
            if d >= 0:
                fd = finish[d]
                if fd < 0.0:
                    waiter[d] = g
                    break
                if fd > t:
                    t = fd
            if release is not None and release[op] > t:
                t = release[op]
            t += dur[op]
            finish[op] = t
            p += 1
            if waiter[op] >= 0:
                wake(waiter[op])
        done += p - p0
        ptr[g] = p
        clock[g] = t
    return finish if done == n else None


def simulate(
    lay: Layout, order: Sequence[Sequence[int]], release: Sequence[float] | None = None
) -> list[float] | None:
    """Finish time of every op under ``order`` (None on a deadlock): the paper's
    ComputeEnergy (an op starts when the previous op on its stage and its input are done)."""
    return longest_paths(order, lay.pred, lay.dur, release)


def peaks(lay: Layout, order: Sequence[Sequence[int]]) -> list[float]:
    """Peak activation held by each GPU stage over its order."""
    out = []
    mem = lay.mem
    for seq in order:
        level = top = 0.0
        for op in seq:
            level += mem[op]
            if level > top:
                top = level
        out.append(top)
    return out


def _check_order(lay: Layout, problem: FusedProblem, order: Sequence[Sequence[int]]) -> None:
    if len(order) != problem.gpu_stages:
        raise ConfigError(
            f"a schedule needs one op order per GPU stage ({problem.gpu_stages}), got {len(order)}"
        )
    seen = [False] * lay.n
    for g, seq in enumerate(order):
        for op in seq:
            if not 0 <= op < lay.n or seen[op] or lay.gpu[op] != g:
                where = lay.key[op] if 0 <= op < lay.n else op
                raise ConfigError(
                    f"op {where} on GPU stage {g} is unknown, repeated or belongs elsewhere; "
                    "every (model, pipeline, microbatch, stage, phase) runs once, on its stage"
                )
            seen[op] = True
    if not all(seen):
        missing = [lay.key[i] for i, s in enumerate(seen) if not s][:5]
        raise ConfigError(f"the schedule misses ops, e.g. {missing}")


def timed(
    problem: FusedProblem,
    order: Sequence[Sequence[int]],
    *,
    method: str = "",
    release: Sequence[float] | None = None,
) -> FusedSchedule:
    """The schedule of an op order (op ids of :func:`layout`), with its times and peaks."""
    lay = layout(problem)
    _check_order(lay, problem, order)
    finish = simulate(lay, order, release)
    if finish is None:
        raise ConfigError("the op order deadlocks: some stage waits on an op ordered after it")
    gpus = tuple(
        tuple(
            ScheduledOp(
                *lay.key[op][:4],
                phase="F" if lay.key[op][4] == 0 else "B",
                start=finish[op] - lay.dur[op],
                end=finish[op],
            )
            for op in seq
        )
        for seq in order
    )
    return FusedSchedule(
        problem=problem,
        gpus=gpus,
        makespan=max(finish),
        lower_bound=lower_bound(problem),
        peak_memory=tuple(peaks(lay, order)),
        method=method,
    )


def order_of(schedule: FusedSchedule) -> Order:
    """The op-id order of a schedule (inverse of :func:`timed`)."""
    idx = layout(schedule.problem).index
    return [
        [idx[(o.model, o.pipeline, o.microbatch, o.stage, 0 if o.phase == "F" else 1)] for o in g]
        for g in schedule.gpus
    ]


# ----------------------------------------------------------------- bounds and baselines


def lower_bound(problem: FusedProblem, *, method: Literal["jackson", "paper"] = "jackson") -> float:
    """A makespan lower bound.

    ``"paper"`` is RLHFuse's (§7.3, as its public code computes it): the larger of each
    model's own single-pipeline critical path ``(M + P - 1) * (f + b)`` and, per GPU stage,
    the earliest arrival of any of its ops + all its work + the shortest chain left after
    any op, maximised over stages.
    ``"jackson"`` (the default) relaxes each stage to one machine whose ops keep their own
    heads (the chain before each op) and tails (the chain after it) and may be preempted;
    Jackson's preemptive schedule solves that relaxation exactly, so the bound is valid;
    it is never below the paper's per-stage term (the same relaxation with every head and
    tail replaced by the stage's minimum) and takes the models' critical paths too.
    """
    if method not in ("jackson", "paper"):
        raise ConfigError(f"lower_bound method must be 'jackson' or 'paper', got {method!r}")
    lay = layout(problem)
    per_stage: list[list[tuple[float, float, float]]] = [[] for _ in range(problem.gpu_stages)]
    for i, (k, _p, _mb, s, phase) in enumerate(lay.key):
        m = problem.models[k]
        head = s * m.forward_s
        if phase == 1:
            head = m.stages * m.forward_s + (m.stages - 1 - s) * m.backward_s
        per_stage[lay.gpu[i]].append((head, lay.dur[i], lay.tail[i]))
    per_model = max(
        (m.microbatches + m.stages - 1) * (m.forward_s + m.backward_s) for m in problem.models
    )
    if method == "paper":
        return max(
            per_model,
            *(
                min(j[0] for j in jobs) + sum(j[1] for j in jobs) + min(j[2] for j in jobs)
                for jobs in per_stage
            ),
        )
    return max(per_model, *(_jackson_preemptive(jobs) for jobs in per_stage))


def _jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Optimal ``max(completion + tail)`` of one preemptive machine with heads and tails:
    always run the released job with the longest tail."""
    jobs = sorted(jobs)
    waiting: list[list[float]] = []  # [-tail, remaining work]
    t = best = 0.0
    i = 0
    while i < len(jobs) or waiting:
        if not waiting and t < jobs[i][0]:
            t = jobs[i][0]
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(waiting, [-jobs[i][2], jobs[i][1]])
            i += 1
        nxt = jobs[i][0] if i < len(jobs) else math.inf
        top = waiting[0]
        run = min(top[1], nxt - t)
        t += run
        top[1] -= run
        if top[1] <= _EPS:
            heapq.heappop(waiting)
            best = max(best, t - top[0])
    return best


def _1f1b_stage(m: PipelineModel, s: int, extra: int = 0) -> list[tuple[int, int]]:
    """(microbatch, phase) order of 1F1B on local stage ``s``, its warm-up lengthened by
    ``extra`` forwards."""
    warm = min(m.stages - 1 - s + extra, m.microbatches)
    seq = [(mb, 0) for mb in range(warm)]
    for i in range(m.microbatches - warm):
        seq += [(warm + i, 0), (i, 1)]
    return seq + [(mb, 1) for mb in range(m.microbatches - warm, m.microbatches)]


def one_f_one_b_streams(
    problem: FusedProblem, extra: Sequence[int] | None = None
) -> list[list[int]]:
    """Each (model, pipeline, stage)'s op ids in 1F1B order (``extra[k]`` more warm-up
    forwards for model ``k``), in model order."""
    lay = layout(problem)
    out = []
    for k, m in enumerate(problem.models):
        more = 0 if extra is None else extra[k]
        for p in range(problem.pipelines(k)):
            for s in range(m.stages):
                out.append([lay.index[(k, p, mb, s, ph)] for mb, ph in _1f1b_stage(m, s, more)])
    return out


def serial_order(problem: FusedProblem, models: Sequence[int]) -> Order:
    """Each GPU stage runs ``models`` one after the other, each in 1F1B order."""
    lay = layout(problem)
    streams = one_f_one_b_streams(problem)
    order: Order = [[] for _ in range(problem.gpu_stages)]
    for k in models:
        for ops in streams:
            if lay.key[ops[0]][0] == k:
                order[lay.gpu[ops[0]]].extend(ops)
    return order


def one_f_one_b(problem: FusedProblem, model: int) -> FusedSchedule:
    """``models[model]`` alone with 1F1B (a problem holding just that model)."""
    solo = msgspec.structs.replace(problem, models=(problem.models[model],))
    return timed(solo, serial_order(solo, [0]), method="1f1b")


def serial_1f1b(problem: FusedProblem) -> FusedSchedule:
    """The models one after the other, each with 1F1B, a barrier between them."""
    lay = layout(problem)
    release = [0.0] * lay.n
    offset = 0.0
    for k in range(len(problem.models)):
        for i, key in enumerate(lay.key):
            if key[0] == k:
                release[i] = offset
        offset += one_f_one_b(problem, k).makespan
    return timed(
        problem,
        serial_order(problem, range(len(problem.models))),
        method="serial-1f1b",
        release=release,
    )


# ------------------------------------------------------------------------ validation


def validate_schedule(schedule: FusedSchedule, *, tol: float = 1e-6) -> None:
    """Raise ``ConfigError`` listing the first violations of ``schedule``; None when valid."""
    problem = schedule.problem
    lay = layout(problem)
    errors: list[str] = []
    end: dict[tuple[int, int, int, int, int], float] = {}
    start: dict[tuple[int, int, int, int, int], float] = {}
    if len(schedule.gpus) != problem.gpu_stages:
        raise ConfigError(
            f"schedule has {len(schedule.gpus)} GPU stages, its problem {problem.gpu_stages}"
        )
    for g, ops in enumerate(schedule.gpus):
        clock = level = top = 0.0
        for o in ops:
            key = (o.model, o.pipeline, o.microbatch, o.stage, 0 if o.phase == "F" else 1)
            i = lay.index.get(key, -1)
            if i < 0 or lay.gpu[i] != g or key in end:
                errors.append(f"op {key} on GPU stage {g} is unknown, misplaced or repeated")
                continue
            if o.start < clock - tol:
                errors.append(f"op {key} on GPU stage {g} starts at {o.start} before {clock}")
            if abs(o.end - o.start - lay.dur[i]) > tol:
                errors.append(f"op {key} lasts {o.end - o.start}, its cost is {lay.dur[i]}")
            clock = max(clock, o.end)
            start[key], end[key] = o.start, o.end
            level += lay.mem[i]
            top = max(top, level)
        if problem.memory_limit is not None and top > problem.memory_limit + tol:
            errors.append(f"GPU stage {g} peaks at {top} > memory_limit {problem.memory_limit}")
        if g < len(schedule.peak_memory) and abs(schedule.peak_memory[g] - top) > tol:
            errors.append(f"GPU stage {g} reports peak {schedule.peak_memory[g]}, it is {top}")
    if len(end) != lay.n:
        errors.append(f"{lay.n - len(end)} ops are missing")
    for i, key in enumerate(lay.key):
        d = lay.pred[i]
        if d >= 0 and key in start and lay.key[d] in end and start[key] < end[lay.key[d]] - tol:
            errors.append(f"op {key} starts before its input {lay.key[d]} ends")
    if end and abs(max(end.values()) - schedule.makespan) > tol:
        errors.append(f"reported makespan {schedule.makespan}, ops end at {max(end.values())}")
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ConfigError("invalid fused schedule: " + "; ".join(errors[:5]) + more)
