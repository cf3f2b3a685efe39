"""The import layers of docs/design.md, as a test: nothing under src/flowrl imports upward.

``LAYERS`` is the one place the order is written. A module belongs to the layer of the
longest entry that is its name or a dotted prefix of it (``flowrl`` itself, the public
facade, matches only the package's ``__init__``). A module may import its own layer and the
layers before it. Every import counts: module level, function-local (the lazy ones too) and
under ``TYPE_CHECKING``. A new top-level package or module must be given a layer here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# low -> high; see docs/design.md for what each room is for
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "flowrl.errors",
        "flowrl._validate",
        "flowrl._config",
        "flowrl._folder_lock",
        "flowrl.tracking",
    ),
    ("flowrl._schema",),
    ("flowrl.events", "flowrl.hooks", "flowrl._observers"),
    ("flowrl.sched",),
    ("flowrl.sim",),
    ("flowrl._protocol",),
    ("flowrl._controller", "flowrl._store"),
    ("flowrl._client",),
    ("flowrl._transport",),
    ("flowrl._launch",),
    ("flowrl._weights",),
    ("flowrl._pipeline",),
    ("flowrl",),
    ("flowrl.rl", "flowrl.models", "flowrl.engines", "flowrl.tasks", "flowrl.sched_hooks"),
    ("flowrl.recipes", "flowrl.integrations", "flowrl.compat", "flowrl.testing"),
    ("flowrl.__main__",),
)
# what the pure planning code never imports, directly or through flowrl
PURE = ("flowrl.sched", "flowrl.sim")
NOT_IN_PURE = ("zmq", "ray", "flowrl._pipeline")


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``flowrl`` package under ``src``."""
    found = {}
    for path in sorted((src / "flowrl").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module), once each, for every import statement anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                # `from flowrl import errors` imports the module flowrl.errors
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in known else base))
    return list(dict.fromkeys(found))


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the room a flowrl module belongs to; None when it has none."""
    best: tuple[int, int] | None = None  # (length of the matching entry, layer)
    for index, rooms in enumerate(LAYERS):
        for room in rooms:
            exact = module == room
            inside = room != "flowrl" and module.startswith(room + ".")
            if (exact or inside) and (best is None or len(room) > best[0]):
                best = (len(room), index)
    return None if best is None else best[1]


def upward_imports(src: Path) -> list[str]:
    """One line per import of a higher layer, naming the file, line and both layers."""
    files = module_files(src)
    known = set(files)
    found = []
    for name, path in files.items():
        mine = layer_of(name)
        for line, target in imports_of(name, path, known):
            theirs = layer_of(target) if target.split(".")[0] == "flowrl" else None
            if mine is not None and theirs is not None and theirs > mine:
                found.append(
                    f"{path.relative_to(src)}:{line}: {name} (layer {mine}) imports "
                    f"{target} (layer {theirs})"
                )
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in module_files(SRC) if layer_of(name) is None)
    assert not unplaced, f"give these a room in LAYERS (and docs/design.md): {unplaced}"


def test_every_room_exists() -> None:
    files = module_files(SRC)
    missing = {
        room
        for rooms in LAYERS
        for room in rooms
        if room not in files and not any(name.startswith(room + ".") for name in files)
    }
    assert not missing, f"LAYERS names rooms that are not in src/: {missing}"


def test_no_module_imports_a_higher_layer() -> None:
    found = upward_imports(SRC)
    assert not found, "imports pointing up the layers:\n" + "\n".join(found)


def test_planning_code_imports_no_zmq_ray_or_pipeline() -> None:
    files = module_files(SRC)
    known = set(files)
    found = [
        f"{path.relative_to(SRC)}:{line}: imports {target}"
        for name, path in files.items()
        if any(name == p or name.startswith(p + ".") for p in PURE)
        for line, target in imports_of(name, path, known)
        if any(target == bad or target.startswith(bad + ".") for bad in NOT_IN_PURE)
    ]
    assert not found, "\n".join(found)


def test_importing_planning_code_loads_no_zmq_ray_or_pipeline() -> None:
    """What runs, not only what is written: parent packages' imports count too."""
    code = (
        "import sys, flowrl.sched, flowrl.sim\n"
        f"bad = {NOT_IN_PURE!r}\n"
        "print(sorted(m for m in sys.modules if m in bad or m.startswith(bad)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _plant(src: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = src / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    "statement",
    [
        "from flowrl._client.base import HubClient",  # absolute
        "from .._client import base",  # relative, names a module
        "import flowrl._client.base",
    ],
)
def test_a_planted_upward_import_is_found(tmp_path: Path, statement: str) -> None:
    """The checker sees an upward import even when it hides in a function."""
    _plant(
        tmp_path,
        {
            "flowrl/__init__.py": "",
            "flowrl/errors.py": "",
            "flowrl/_client/__init__.py": "",
            "flowrl/_client/base.py": "from flowrl._schema import columns\n",
            "flowrl/_schema/__init__.py": "",
            "flowrl/_schema/columns.py": f"""
                from flowrl.errors import ConfigError

                def late():
                    {statement}
                """,
        },
    )
    assert upward_imports(tmp_path) == [
        "flowrl/_schema/columns.py:5: flowrl._schema.columns (layer 1) imports "
        "flowrl._client.base (layer 7)"
    ]
