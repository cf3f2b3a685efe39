"""The ``flowrl`` command line: ``flowrl run NAME`` runs a recipe, ``flowrl sim`` the simulator."""

from __future__ import annotations

import argparse
import importlib
import sys

RECIPES = {"grpo": "flowrl.recipes.grpo_cli"}  # modules with main(argv); light to import


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A recipe and the simulator parse their own options, --help included.
    if argv[:1] == ["run"] and len(argv) > 1 and argv[1] in RECIPES:
        recipe = importlib.import_module(RECIPES[argv[1]])
        return int(recipe.main(argv[2:]) or 0)
    if argv[:1] == ["sim"]:
        from flowrl.sim.cli import main as sim_main

        return sim_main(argv[1:])
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe (the main job: flowrl run grpo)")
    run.add_argument("recipe", choices=sorted(RECIPES), help="the recipe's name")
    sub.add_parser("sim", help="simulate a disaggregated RL cluster (flowrl sim --help)")
    parser.parse_args(argv)  # only errors and help get here
    return 2


if __name__ == "__main__":
    sys.exit(main())
