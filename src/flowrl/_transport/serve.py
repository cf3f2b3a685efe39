"""Process entry point: ``python -m flowrl._transport.serve <json spec>``.

Runs the controller or one storage unit until a Shutdown request arrives. Started by
``flowrl.launch_hub``; the spec is a msgspec JSON document (no pickle).
"""

from __future__ import annotations

import sys

import msgspec

from flowrl._transport.specs import ControllerSpec, ServerSpec


def main(argv: list[str]) -> None:
    spec = msgspec.json.decode(argv[0], type=ServerSpec)
    fields = {f: getattr(spec, f) for f in spec.__struct_fields__}
    if isinstance(spec, ControllerSpec):
        from flowrl._transport.controller_server import serve_controller

        serve_controller(**fields)
    else:
        from flowrl._transport.unit_server import serve_unit

        serve_unit(**fields)


if __name__ == "__main__":
    main(sys.argv[1:])
