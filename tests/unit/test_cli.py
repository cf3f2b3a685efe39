"""The ``flowrl`` command line: a recipe's own help, and bad configurations refused at once.

Before the fix, ``flowrl run grpo --help`` printed ``flowrl run``'s help, and bad values
failed after the 30 s warm-up with an internal traceback (or hung forever).
"""

from __future__ import annotations

import re

import msgspec
import pytest

from flowrl.__main__ import main
from flowrl.errors import ConfigError
from flowrl.recipes.grpo_config import GRPOConfig, flag, groups_per_put


def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_run_grpo_help_is_the_recipes_with_every_option_described(capsys) -> None:
    text = _help(capsys, ["run", "grpo", "--help"])
    assert text.startswith("usage: flowrl run grpo")
    options = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]
    described = {o.split()[0].rstrip(","): " ".join(o.split()) for o in options}
    for field in GRPOConfig.__struct_fields__:
        entry = described[flag(field)]
        default = getattr(GRPOConfig(), field)
        assert f"(default: {default})" in entry, entry
        assert len(entry) > len(flag(field)) + len(f"(default: {default})") + 10, entry
    assert "--resume" in described


def test_other_help_pages_still_work(capsys) -> None:
    assert "{grpo}" in _help(capsys, ["run", "--help"])
    assert "usage: flowrl sim" in _help(capsys, ["sim", "--help"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-staleness", "-1"], "--max-staleness -1: expected an int >= 0"),
        (["--prompts-per-step", "0"], "--prompts-per-step 0: expected an int >= 1"),
        (["--group-size", "1"], "--group-size 1: expected an int >= 2; GRPO normalises"),
        (["--temperature", "0"], "--temperature 0.0: expected a number > 0"),
        (["--max-digits", "7"], "--max-digits 7: expected an int in [1, 6]"),
        (["--d-model", "30"], "--d-model 30: expected a positive multiple of 4"),
        (["--noise", "1.5"], "--noise 1.5: expected a share in [0, 1]"),
        (
            ["--prompts-per-step", "64", "--group-size", "8", "--hub-capacity", "256"],
            "--prompts-per-step 64 x --group-size 8 = 512 samples per step do not fit in "
            "--hub-capacity 256",
        ),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ],
)
def test_a_bad_configuration_is_refused_before_anything_runs(capsys, argv, says) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "grpo", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"flowrl run grpo: error: {says}" in err
    assert "Traceback" not in err and "warm-up" not in err


def test_the_config_checks_itself_in_python_too() -> None:
    with pytest.raises(ConfigError, match="--group-size 1"):
        GRPOConfig(group_size=1)
    with pytest.raises(ConfigError, match=r"--steps '3': expected a int"):
        GRPOConfig(steps="3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--max-staleness True"):
        GRPOConfig(max_staleness=True)
    cfg = GRPOConfig(lr=1)  # an int where a float is expected is fine
    with pytest.raises(ConfigError, match="--log-every -1"):
        msgspec.structs.replace(cfg, log_every=-1)


@pytest.mark.parametrize(
    ("prompts", "group", "batch", "expected"),
    [(16, 8, 32, 4), (2, 8, 32, 2), (6, 8, 32, 3), (7, 8, 32, 1), (16, 1 + 1, 5, 2), (3, 4, 2, 1)],
)
def test_a_put_is_a_divisor_of_the_steps_groups(prompts, group, batch, expected) -> None:
    cfg = GRPOConfig(prompts_per_step=prompts, group_size=group, rollout_batch=batch)
    per_put = groups_per_put(cfg)
    assert per_put == expected
    assert prompts % per_put == 0 and (per_put == 1 or per_put * group <= batch)


@pytest.mark.parametrize(
    ("argv", "says"), [(["run", "nope"], "invalid choice: 'nope'"), ([], "required: command")]
)
def test_an_unknown_recipe_or_no_command_is_a_usage_error(capsys, argv, says) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
