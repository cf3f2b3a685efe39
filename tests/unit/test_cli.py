"""The ``flowrl`` command line: a recipe's own help, and bad configurations refused at once.

Before the fix, ``flowrl run grpo --help`` printed ``flowrl run``'s help, and bad values
failed after the 30 s warm-up with an internal traceback (or hung forever).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from grpo_runs import TINY

from flowrl.__main__ import main
from flowrl.errors import ConfigError
from flowrl.recipes.grpo_cli import check_out_folder
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
        # inf and nan pass every comparison check; inf failed after the warm-up
        (["--lr", "inf"], "--lr inf: expected a finite number"),
        (["--kl-coef", "nan"], "--kl-coef nan: expected a finite number"),
        (["--engine", "PATH"], "argument --engine: invalid choice: 'PATH'"),
        (["--metrics-port", "70000"], "--metrics-port 70000: expected a TCP port in [1, 65535]"),
        (["--logger", "console,tb"], "--logger 'console,tb': unknown logger backend(s) ['tb']"),
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


def test_engine_flags_show_their_choices_in_the_help(capsys) -> None:
    text = _help(capsys, ["run", "grpo", "--help"])
    assert "--engine {builtin,torch,vllm}" in text
    assert "--trainer {builtin,torch,deepspeed,megatron}" in text
    assert "--model {tinylm,llama}" in text


@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("{file}", "expected a folder, but the path is a file"),
        ("{file}/runs", "expected a folder, but the path is under {file}, which is a file"),
    ],
)
def test_an_out_that_cannot_hold_runs_is_refused_with_the_other_flags(
    tmp_path: Path, capsys, out: str, says: str
) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["run", "grpo", "--out", out.format(file=file)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"flowrl run grpo: error: --out '{out.format(file=file)}': " in err
    assert says.format(file=file) in err and "Traceback" not in err


def test_an_unwritable_out_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("this user can write in a 0500 folder (root)")
    with pytest.raises(ConfigError, match="this user cannot create folders in"):
        check_out_folder(str(locked / "runs"))


def test_help_and_argument_errors_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from flowrl.__main__ import main\n"
        "for argv in (['run', 'grpo', '--help'], ['run', 'grpo', '--steps', 'x'],"
        " ['run', 'grpo', '--lr', '-1']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


def test_ctrl_c_ends_the_run_with_one_line_saying_how_to_resume(tmp_path: Path) -> None:
    argv = [
        *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"),
        "--steps=1000",
        "--log-every=1",
        "--checkpoint-every=1",
        f"--out={tmp_path}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "run", "grpo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until two steps are done (so one is checkpointed)
            if re.match(r"step +2/1000 ", line):
                break
        else:
            pytest.fail(f"the run ended before step 2: {proc.wait()}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes (a timeout left them open)
    assert proc.returncode == 130
    lines = [ln for ln in err.splitlines() if ln.startswith("flowrl run grpo:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    run_dir = next(tmp_path.iterdir())
    assert lines[0].startswith("flowrl run grpo: interrupted after ")
    assert lines[0].endswith(f"with: flowrl run grpo --resume {run_dir}")
    assert "\r" not in err  # stderr is a pipe: no progress-bar frames
