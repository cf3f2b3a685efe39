"""@stage validates once, at decoration; errors name the stage, its file:line and a hint."""

from __future__ import annotations

import re
import sys

import msgspec
import pytest

from flowrl import BalancedSampler, Column, GroupSampler
from flowrl._pipeline.stage import StageContext, StageSpec, stage
from flowrl.errors import ConfigError, PipelineError

HERE = re.escape(__file__)


def _check(message: str, name: str) -> None:
    """The message names the stage and this file with a line, and ends with a hint."""
    assert f"stage {name!r} at " in message
    assert re.search(rf"{HERE}:\d+", message), message
    assert "; " in message.split(f"{__file__}:")[1], message


def test_error_names_the_exact_decoration_line() -> None:
    line = sys._getframe().f_lineno + 3
    with pytest.raises(ConfigError) as info:

        @stage(inputs=["x"], outputs=["y"], batch_size=0)
        def score(batch):
            return {}

    assert f"{__file__}:{line}" in str(info.value)
    _check(str(info.value), "score")
    assert "batch_size must be a positive int, got 0" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"inputs": ["x"], "outputs": ["y"]}, ConfigError, "batch_size is missing"),
        ({"inputs": ["x"], "batch_size": 2.0}, ConfigError, "batch_size must be a positive int"),
        ({"inputs": ["x"], "batch_size": True}, ConfigError, "batch_size must be a positive int"),
        ({"inputs": ["x"], "batch_size": 2, "workers": 0}, ConfigError, "workers must be"),
        ({"inputs": ["x"], "batch_size": 2, "min_batch": 3}, ConfigError, "min_batch"),
        ({"inputs": ["x"], "batch_size": 2, "lease_timeout": 0}, ConfigError, "lease_timeout"),
        ({"inputs": ["x"], "batch_size": 2, "prefetch": 0}, ConfigError, "prefetch must be"),
        ({"inputs": ["x"], "batch_size": 2, "prefetch": 2.0}, ConfigError, "prefetch must be"),
        ({"inputs": ["x"], "batch_size": 2, "sampler": "fifo"}, ConfigError, "flowrl Sampler"),
        (
            {"inputs": ["x"], "batch_size": 2, "sampler": BalancedSampler(2)},
            ConfigError,
            "pass workers=2",
        ),
        ({"inputs": "x", "batch_size": 2}, PipelineError, "write inputs=['x']"),
        ({"inputs": ["x", "x"], "batch_size": 2}, PipelineError, "name ['x'] more than once"),
        ({"inputs": ["x"], "outputs": ["y", "y"], "batch_size": 2}, PipelineError, "outputs"),
        ({"inputs": ["x"], "outputs": ["x"], "batch_size": 2}, PipelineError, "both inputs"),
        ({"inputs": ["no-dash"], "batch_size": 2}, PipelineError, "Python identifiers"),
        (
            {"inputs": [Column.scalar("x", "int64")], "batch_size": 2},
            PipelineError,
            "is not a column name",
        ),
    ],
)
def test_bad_options_are_rejected_with_stage_and_location(
    kwargs: dict, error: type[Exception], text: str
) -> None:
    with pytest.raises(error) as info:

        @stage(**kwargs)
        def reward(batch):
            return {}

    _check(str(info.value), "reward")
    assert text in str(info.value)


def test_prefetch_applies_to_consuming_stages_only() -> None:
    with pytest.raises(ConfigError, match="prefetch applies to consuming stages only"):

        @stage(outputs=["y"], batch_size=2, prefetch=4)
        def source():
            return {}


def test_consumer_must_take_one_batch_argument() -> None:
    with pytest.raises(PipelineError) as info:

        @stage(inputs=["x"], outputs=["y"], batch_size=2)
        def reward():
            return {}

    _check(str(info.value), "reward")
    assert "one batch argument" in str(info.value)

    with pytest.raises(PipelineError, match="one batch argument"):

        @stage(inputs=["x"], outputs=["y"], batch_size=2)
        def two(batch, other):
            return {}


def test_source_must_take_no_arguments_and_declare_outputs() -> None:
    with pytest.raises(PipelineError) as info:

        @stage(outputs=["x"], batch_size=2)
        def prompts(batch):
            return {}

    _check(str(info.value), "prompts")
    assert "is a source" in str(info.value) and "add inputs=" in str(info.value)

    with pytest.raises(PipelineError, match="must declare outputs"):

        @stage(batch_size=2)
        def nothing():
            return None


def test_generators_async_and_non_callables() -> None:
    with pytest.raises(PipelineError, match="is a generator"):

        @stage(inputs=["x"], outputs=["y"], batch_size=2)
        def gen(batch):
            yield {}

    with pytest.raises(ConfigError, match="generator source runs in one worker"):

        @stage(outputs=["x"], batch_size=2, workers=2)
        def src():
            yield {}

    with pytest.raises(PipelineError, match="is async"):

        @stage(inputs=["x"], batch_size=2)
        async def fetch(batch):
            return None

    with pytest.raises(PipelineError, match="decorates a function or a class"):
        stage(inputs=["x"], batch_size=2, name="table")({"not": "callable"})


def test_names_must_be_identifiers_and_bare_decorator_is_explained() -> None:
    with pytest.raises(ConfigError, match="pass name='my_stage'"):
        stage(inputs=["x"], batch_size=2)(lambda batch: {})
    spec = stage(inputs=["x"], batch_size=2, name="tail")(lambda batch: None)
    assert spec.name == "tail"
    with pytest.raises(ConfigError, match=r"without arguments; write @flowrl.stage\("):

        @stage  # type: ignore[arg-type]
        def bare(batch):
            return {}


def test_class_stage_checks() -> None:
    with pytest.raises(PipelineError) as info:

        @stage(inputs=["x"], outputs=["y"], batch_size=2)
        class Needs:
            def __init__(self, path):
                self.path = path

            def __call__(self, batch):
                return {}

    _check(str(info.value), "Needs")
    assert "load models in setup(self)" in str(info.value)

    with pytest.raises(PipelineError, match="has no __call__"):

        @stage(inputs=["x"], batch_size=2)
        class NoCall:
            pass

    with pytest.raises(PipelineError, match=r"must take \(self\) or \(self, ctx\)"):

        @stage(inputs=["x"], batch_size=2)
        class BadSetup:
            def setup(self, a, b):
                pass

            def __call__(self, batch):
                return None

    with pytest.raises(PipelineError, match="one batch argument"):

        @stage(inputs=["x"], batch_size=2)
        class NoBatch:
            def __call__(self):
                return None


def test_valid_specs_are_frozen_and_describe_the_stage() -> None:
    @stage(
        inputs=["prompt", "response"],
        outputs=[Column.scalar("reward", "float32"), "note"],
        batch_size=8,
        workers=2,
        sampler=GroupSampler(4),
        min_batch=4,
    )
    def score(batch):
        return {}

    assert isinstance(score, StageSpec)
    assert score.name == "score" and not score.is_source
    assert score.inputs == ("prompt", "response") and score.outputs == ("reward", "note")
    assert score.output_columns == (Column.scalar("reward", "float32"),)
    assert (score.batch_size, score.workers, score.min_batch) == (8, 2, 4)
    assert score.file == __file__ and score.where.startswith("stage 'score' (")
    with pytest.raises(AttributeError):
        score.batch_size = 4  # type: ignore[misc]

    @stage(outputs=["x"], batch_size=1)
    def numbers():
        yield {"x": [1]}

    assert numbers.is_source and numbers.is_generator

    @stage(inputs=["x"], batch_size=1)
    class Model:
        def setup(self, ctx: StageContext) -> None:
            self.worker = ctx.worker

        def __call__(self, batch):
            return None

    assert Model.is_class and Model.setup_takes_context
    assert msgspec.structs.replace(Model, workers=3).workers == 3
