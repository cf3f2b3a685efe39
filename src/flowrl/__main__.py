"""The ``flowrl`` command line: ``flowrl run NAME`` runs a recipe, ``flowrl sim`` the simulator."""

from __future__ import annotations

import argparse
import importlib
import sys

RECIPES = {"grpo": "flowrl.recipes.grpo_arith"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe (the main job: flowrl run grpo)")
    run.add_argument("recipe", choices=sorted(RECIPES))
    sub.add_parser("sim", add_help=False, help="simulate a disaggregated RL cluster")
    args, rest = parser.parse_known_args(argv)
    if args.command == "sim":
        from flowrl.sim.cli import main as sim_main

        return sim_main(rest)
    recipe = importlib.import_module(RECIPES[args.recipe])
    return int(recipe.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
