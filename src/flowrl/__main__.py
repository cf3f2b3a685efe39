"""The ``flowrl`` command line: ``flowrl run NAME`` runs a recipe, ``flowrl sim`` the
simulator, ``flowrl dashboard --hub ADDRESS`` serves a live page of a running hub."""

from __future__ import annotations

import argparse
import importlib
import sys
import threading

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
    if argv[:1] == ["dashboard"]:
        return dashboard(argv[1:])
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe (the main job: flowrl run grpo)")
    run.add_argument("recipe", choices=sorted(RECIPES), help="the recipe's name")
    sub.add_parser("sim", help="simulate a disaggregated RL cluster (flowrl sim --help)")
    sub.add_parser("dashboard", help="a live page of a running hub (flowrl dashboard --help)")
    parser.parse_args(argv)  # only errors and help get here
    return 2


def dashboard(argv: list[str], *, stop: threading.Event | None = None) -> int:
    """``flowrl dashboard``: serve until Ctrl-C (or until ``stop`` is set, in tests)."""
    p = argparse.ArgumentParser(
        prog="flowrl dashboard",
        description="Serve a live page of a running hub (launch_hub / launch_ray_hub) on "
        "this machine and print its URL; Ctrl-C stops it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hub", required=True, metavar="ADDRESS", help="the hub's .address")
    p.add_argument(
        "--key-file",
        metavar="PATH",
        help="the hub's key (a 0600 file from hub.key.save) for a hub on TCP; else "
        "FLOWRL_HUB_KEY or FLOWRL_HUB_KEY_FILE (a key on the command line would be "
        "visible to every user)",
    )
    p.add_argument("--port", type=int, default=8365, help="the page's port (0: any free one)")
    p.add_argument("--addr", default="127.0.0.1", help="the interface to listen on")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between updates")
    args = p.parse_args(argv)
    from flowrl import HubKey, connect, serve_dashboard
    from flowrl.errors import FlowRLError

    try:
        key = None if args.key_file is None else HubKey.load(args.key_file)
        hub = connect(args.hub, key=key)
    except FlowRLError as exc:
        p.error(str(exc))
    try:
        page = serve_dashboard(hub, port=args.port, addr=args.addr, interval=args.interval)
    except FlowRLError as exc:
        hub.close()
        p.error(str(exc))
    print(f"flowrl dashboard: {page.url} (Ctrl-C stops it)", flush=True)
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        page.close()
        hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
