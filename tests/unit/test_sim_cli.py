"""The ``flowrl sim`` entry point and the package export lists."""

from __future__ import annotations

import json

import pytest

import flowrl.sched
import flowrl.sim
from flowrl.sim.cli import main

pytest.importorskip("highspy")


def test_cli_json_and_plot(tmp_path, capsys) -> None:
    png = tmp_path / "r.png"
    rc = main(
        [
            "--gpus",
            "16",
            "--requests",
            "300",
            "--steps",
            "1",
            "--max-len",
            "4096",
            "--schemes",
            "static-throughput,planner+balancer",
            "--json",
            "--plot",
            str(png),
            "--tick",
            "0.5",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"static-throughput", "planner+balancer"}
    assert out["planner+balancer"]["mean_makespan_s"] > 0
    assert png.stat().st_size > 1000


def test_cli_table_and_errors(tmp_path, capsys) -> None:
    trace = tmp_path / "t.txt"
    trace.write_text("100 200 4000 50\n300\n")
    assert (
        main(
            [
                "--gpus",
                "8",
                "--requests",
                "100",
                "--steps",
                "1",
                "--trace",
                str(trace),
                "--schemes",
                "static-latency",
                "--tick",
                "0.5",
            ]
        )
        == 0
    )
    assert "static-latency" in capsys.readouterr().out
    assert main(["--schemes", "nope"]) == 2
    assert "unknown scheme" in capsys.readouterr().err


@pytest.mark.parametrize("mod", [flowrl.sched, flowrl.sim])
def test_all_is_sorted_and_complete(mod) -> None:
    assert mod.__all__ == sorted(mod.__all__)
    public = {n for n in vars(mod) if not n.startswith("_") and n not in {"annotations"}}
    submodules = {n for n in public if type(getattr(mod, n)).__name__ == "module"}
    assert set(mod.__all__) == public - submodules


def test_without_highs_the_planner_schemes_are_refused_before_simulating(
    capsys, monkeypatch
) -> None:
    """After the README's install (no 'sched' extra) `flowrl sim` simulated for minutes and
    then failed; it now says so at once and names the schemes that run without HiGHS."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "highspy" else real(name, *a)
    )
    simulated = []
    monkeypatch.setattr("flowrl.sim.cli.run_schemes", lambda *a, **k: simulated.append(a))
    assert main(["--schemes", "static-throughput,planner+balancer"]) == 2
    err = capsys.readouterr().err
    assert "scheme(s) planner+balancer plan with HiGHS, which is not installed" in err
    assert "--schemes static-throughput,static-latency,balancer-only" in err
    assert simulated == []


def test_help_shows_defaults_and_the_table_has_a_legend(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "(default: 64)" in capsys.readouterr().out
    rc = main(
        [
            "--gpus",
            "16",
            "--requests",
            "200",
            "--steps",
            "1",
            "--max-len",
            "2048",
            "--schemes",
            "static-throughput,static-latency",
            "--tick",
            "0.5",
        ]
    )
    assert rc == 0
    assert "vs best static: tok/s over the best static scheme's tok/s" in capsys.readouterr().out
