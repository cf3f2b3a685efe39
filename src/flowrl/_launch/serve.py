"""Process entry point: ``python -m flowrl._launch.serve <launcher pid>``, its spec on stdin.

Runs the controller or one storage unit until a Shutdown request arrives. Started by
``flowrl.launch_hub``; the spec is a msgspec JSON document (no pickle), read from stdin
because it may hold the hub key (a command line is visible to every user).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

import msgspec

from flowrl._launch.specs import ControllerSpec, ServerSpec


def _exit_with_parent(parent: int, leftovers: str | None, interval: float = 1.0) -> None:
    """Servers must not outlive the process that launched them (e.g. one killed by a
    signal before it could close the hub): exit once it is gone, removing ``leftovers``
    (a unit's shared memory). ``parent`` comes from the launcher, so a launcher that died
    before this process started is noticed too."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if leftovers is not None:
            shutil.rmtree(leftovers, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="flowrl-parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=ServerSpec)
    _exit_with_parent(int(argv[0]), getattr(spec, "shm_folder", None))
    fields = {f: getattr(spec, f) for f in spec.__struct_fields__}
    if isinstance(spec, ControllerSpec):
        from flowrl._transport.controller_server import serve_controller

        serve_controller(**fields)
    else:
        from flowrl._transport.unit_server import serve_unit

        serve_unit(**fields)


if __name__ == "__main__":
    main(sys.argv[1:])
