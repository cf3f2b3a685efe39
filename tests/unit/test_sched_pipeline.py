"""Invariants of fused pipeline schedules (RLHFuse intra-stage fusion): validity of every
schedule produced, the lower bounds, the 1F1B closed forms, the JSON file, bad input."""

from __future__ import annotations

import itertools
import math
import random

import msgspec
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import (
    FusedProblem,
    FusedSchedule,
    PipelineModel,
    anneal_schedule,
    concurrent_1f1b,
    greedy_schedule,
    lower_bound,
    one_f_one_b,
    search_schedule,
    serial_1f1b,
    timed,
    validate_schedule,
)
from flowrl.sched.pipeline_improve import justify, tabu_search
from flowrl.sched.pipeline_schedule import layout, order_of, simulate


def _problem(
    pp: tuple[int, int] = (4, 2), gbs: int = 4, limit: float | None = None
) -> FusedProblem:
    n = max(pp)
    return FusedProblem(
        gpu_stages=n,
        models=(
            PipelineModel(
                name="actor",
                stages=pp[0],
                microbatches=gbs * pp[0] // n,
                forward_s=1.0,
                backward_s=2.0,
                activation=1.0,
            ),
            PipelineModel(
                name="critic",
                stages=pp[1],
                microbatches=gbs * pp[1] // n,
                forward_s=0.5,
                backward_s=1.0,
                activation=0.5,
                reverse=True,
            ),
        ),
        memory_limit=limit,
    )


PROBLEMS = [_problem((4, 2), 4), _problem((4, 4), 8), _problem((4, 2), 8, limit=4.0)]


@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 5), (4, 4), (6, 3)])
def test_one_f_one_b_matches_closed_form(stages: int, mbs: int) -> None:
    p = FusedProblem(
        gpu_stages=stages,
        models=(
            PipelineModel(
                name="m",
                stages=stages,
                microbatches=mbs,
                forward_s=1.5,
                backward_s=2.5,
                activation=2.0,
            ),
        ),
    )
    s = one_f_one_b(p, 0)
    validate_schedule(s)
    assert s.makespan == pytest.approx((mbs + stages - 1) * 4.0)
    assert s.peak_memory == tuple(2.0 * min(stages - st, mbs) for st in range(stages))
    # one model alone: 1F1B is optimal and the Jackson bound proves it
    assert lower_bound(p) == pytest.approx(s.makespan)


@pytest.mark.parametrize("p", PROBLEMS, ids=["4/2", "4/4", "4/2-mem"])
def test_every_schedule_is_valid_and_above_both_bounds(p: FusedProblem) -> None:
    lb, lb_paper = lower_bound(p), lower_bound(p, method="paper")
    assert lb >= lb_paper - 1e-9
    serial = serial_1f1b(p)
    assert serial.makespan == pytest.approx(
        sum(one_f_one_b(p, k).makespan for k in range(len(p.models)))
    )
    greedy = greedy_schedule(p)
    annealed = anneal_schedule(p, greedy, iterations=200, memory_iterations=50, seed=1)
    ours = search_schedule(p, samples=8, memory_iterations=50, seed=1)
    for s in (serial, greedy, annealed, ours):
        validate_schedule(s)
        assert s.makespan >= lb - 1e-9
        if p.memory_limit is not None:
            assert max(s.peak_memory) <= p.memory_limit + 1e-9
    assert annealed.makespan <= greedy.makespan + 1e-9
    assert ours.makespan <= greedy.makespan + 1e-9
    assert ours.makespan < serial.makespan  # fusion fills the bubbles
    assert search_schedule(p, samples=8, memory_iterations=50, seed=1) == ours  # deterministic


def test_search_reaches_the_bound_on_a_symmetric_pair() -> None:
    # Chimera's case: one model in both directions, 4 stages, 4 micro-batches each
    m = PipelineModel(name="a", stages=4, microbatches=4, forward_s=1.0, backward_s=2.0)
    p = FusedProblem(gpu_stages=4, models=(m, msgspec.structs.replace(m, reverse=True)))
    s = search_schedule(p)
    assert s.makespan == pytest.approx(lower_bound(p))
    assert s.makespan < serial_1f1b(p).makespan


def test_memory_phase_never_lengthens_the_makespan() -> None:
    p = _problem((4, 4), 8)
    base = anneal_schedule(p, iterations=0)
    lighter = anneal_schedule(p, base, iterations=0, memory_iterations=300, seed=2)
    validate_schedule(lighter)
    assert lighter.makespan <= base.makespan + 1e-9
    assert max(lighter.peak_memory) <= max(base.peak_memory) + 1e-9


def test_brute_force_optimum_is_between_bound_and_search() -> None:
    """Every valid order of a tiny instance: the bound is below the optimum, and our
    search finds it."""
    p = FusedProblem(
        gpu_stages=2,
        models=(
            PipelineModel(name="a", stages=2, microbatches=2, forward_s=1.0, backward_s=2.0),
            PipelineModel(
                name="b", stages=2, microbatches=1, forward_s=1.0, backward_s=1.0, reverse=True
            ),
        ),
    )
    lay = layout(p)

    def orders(g: int) -> list[list[int]]:  # F before B of each micro-batch: 90 of 720
        ops = [i for i in range(lay.n) if lay.gpu[i] == g]
        return [
            list(o)
            for o in itertools.permutations(ops)
            if all(
                o.index(lay.index[(*lay.key[i][:4], 0)]) < o.index(i) for i in o if lay.key[i][4]
            )
        ]

    best = float("inf")
    for o0 in orders(0):
        for o1 in orders(1):
            finish = simulate(lay, [o0, o1])
            if finish is not None:
                best = min(best, max(finish))
    assert lower_bound(p) <= best + 1e-9
    assert search_schedule(p).makespan == pytest.approx(best)


def test_json_round_trip_and_tampering_is_caught() -> None:
    s = search_schedule(PROBLEMS[0], samples=4)
    back = FusedSchedule.from_json(s.to_json())
    assert back == s and order_of(back) == order_of(s)
    doc = msgspec.json.decode(s.to_json())
    first = doc["gpus"][0][0]
    doc["gpus"][0][0], doc["gpus"][0][1] = doc["gpus"][0][1], first  # breaks times
    with pytest.raises(ConfigError, match="invalid fused schedule"):
        FusedSchedule.from_json(msgspec.json.encode(doc))
    doc = msgspec.json.decode(s.to_json())
    doc["format"] = "other/9"
    with pytest.raises(ConfigError, match="format"):
        FusedSchedule.from_json(msgspec.json.encode(doc))
    with pytest.raises(ConfigError, match="not a fused schedule"):
        FusedSchedule.from_json(b'{"gpus": 3}')


def test_validator_catches_overlap_dependency_and_memory() -> None:
    p = _problem((4, 2), 4)
    s = serial_1f1b(p)
    ops = list(s.gpus[1])
    ops[0] = msgspec.structs.replace(ops[0], start=ops[0].start - 0.5, end=ops[0].end - 0.5)
    bad = msgspec.structs.replace(s, gpus=(s.gpus[0], tuple(ops), *s.gpus[2:]))
    with pytest.raises(ConfigError, match="before its input"):
        validate_schedule(bad)
    squeezed = msgspec.structs.replace(s, problem=msgspec.structs.replace(p, memory_limit=1.5))
    with pytest.raises(ConfigError, match="memory_limit"):
        validate_schedule(squeezed)
    missing = msgspec.structs.replace(s, gpus=(s.gpus[0][1:], *s.gpus[1:]))
    with pytest.raises(ConfigError, match="missing"):
        validate_schedule(missing)


def test_random_orders_are_valid_or_rejected_as_deadlocks() -> None:
    p = _problem((4, 2), 4, limit=3.0)
    lay = layout(p)
    lb = lower_bound(p)
    rng = random.Random(0)
    outcomes = {"valid": 0, "deadlock": 0}
    for _ in range(200):
        order = [[i for i in range(lay.n) if lay.gpu[i] == g] for g in range(p.gpu_stages)]
        for seq in order:
            rng.shuffle(seq)
            # half the time, sort by (microbatch, phase): deadlock-free orders
            if rng.random() < 0.5:
                seq.sort(key=lambda i: (lay.key[i][2], lay.key[i][4], lay.key[i][0]))
        try:
            s = timed(p, order)
        except ConfigError as exc:
            assert "deadlock" in str(exc)
            outcomes["deadlock"] += 1
            continue
        outcomes["valid"] += 1
        assert s.makespan >= lb - 1e-9
        if max(s.peak_memory) <= 3.0:
            validate_schedule(s)
        else:
            with pytest.raises(ConfigError, match="memory_limit"):
                validate_schedule(s)
    assert outcomes["valid"] and outcomes["deadlock"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"gpu_stages": 6}, "multiple"),
        ({"memory_limit": 0.1}, "memory_limit"),
        ({"models": ()}, "at least one"),
    ],
)
def test_bad_problems_are_rejected(kwargs: dict[str, object], match: str) -> None:
    base = {"gpu_stages": 4, "models": _problem().models, **kwargs}
    with pytest.raises(ConfigError, match=match):
        FusedProblem(**base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="microbatches"):
        PipelineModel(name="x", stages=2, microbatches=0, forward_s=1, backward_s=1)
    with pytest.raises(ConfigError, match="method"):
        lower_bound(_problem(), method="tight")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "p,iterations", [(_problem((4, 4), 8), 2000), (_problem((4, 2), 8, limit=4.0), 500)]
)
def test_annealing_improves_on_its_greedy_start(p: FusedProblem, iterations: int) -> None:
    """The annealing used to accept every move at a temperature of the whole makespan and
    never improved on its greedy start; it now cools every iteration."""
    greedy = greedy_schedule(p)
    annealed = anneal_schedule(p, greedy, iterations=iterations, seed=0)
    validate_schedule(annealed)
    assert annealed.makespan < greedy.makespan
    assert anneal_schedule(p, greedy, iterations=iterations, seed=0) == annealed


def test_justify_and_tabu_never_lengthen_and_keep_memory() -> None:
    p = _problem((4, 2), 8, limit=4.0)
    lay = layout(p)
    bound = lower_bound(p)
    for start in (greedy_schedule(p), serial_1f1b(p)):
        order = order_of(start)
        span = max(simulate(lay, order) or [math.inf])
        for improved in (
            justify(lay, order, 4.0),
            tabu_search(lay, order, 4.0, bound, iterations=100, rng=random.Random(0)),
        ):
            s = timed(p, improved)
            validate_schedule(s)
            assert s.makespan <= span + 1e-9


def test_concurrent_1f1b_refuses_a_limit_it_deadlocks_under() -> None:
    roomy = concurrent_1f1b(_problem((4, 4), 4, limit=8.0))
    validate_schedule(roomy)
    assert roomy.makespan < serial_1f1b(_problem((4, 4), 4)).makespan
    with pytest.raises(ConfigError, match="memory_limit"):
        concurrent_1f1b(_problem((4, 4), 4, limit=1.0))


def test_one_activation_of_memory_still_gets_a_schedule() -> None:
    """With room for one micro-batch per stage every list schedule deadlocks; the search
    (and the greedy) used to raise, they now fall back to one micro-batch at a time."""
    p = _problem((4, 4), 4, limit=1.0)
    for s in (greedy_schedule(p), search_schedule(p, samples=2, iterations=20)):
        validate_schedule(s)
        assert max(s.peak_memory) <= 1.0
