"""The public surface: ``flowrl.__all__`` is sorted and complete; concrete classes are final."""

from __future__ import annotations

import ast
import inspect
import types

import pytest

import flowrl
import flowrl.errors
import flowrl.events
import flowrl.hooks
import flowrl.sched_hooks
import flowrl.testing


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of the imports ``flowrl/__init__.py`` makes for type checkers."""
    tree = ast.parse(inspect.getsource(flowrl))
    blocks = [
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    ]
    return {
        alias.asname or alias.name: str(node.module)
        for block in blocks
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def _names_bound_in_init() -> set[str]:
    """Every public name ``flowrl/__init__.py`` binds (lazy imports and assignments)."""
    tree = ast.parse(inspect.getsource(flowrl))
    names = set(_type_checking_imports())
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    names.discard("__all__")
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def test_all_is_sorted() -> None:
    assert list(flowrl.__all__) == sorted(flowrl.__all__)


def test_all_has_no_duplicates() -> None:
    assert len(set(flowrl.__all__)) == len(flowrl.__all__)


def test_all_is_complete() -> None:
    assert set(flowrl.__all__) == _names_bound_in_init()


def test_lazy_homes_match_the_type_checking_imports() -> None:
    """``_HOMES`` (what runs) and the ``TYPE_CHECKING`` imports (what type checkers see) agree."""
    assert _type_checking_imports() == flowrl._HOMES


def test_every_name_in_all_exists() -> None:
    for name in flowrl.__all__:
        assert hasattr(flowrl, name), name


def test_public_module_attributes_are_all_listed() -> None:
    """Nothing public leaks from the package namespace beyond ``__all__`` and sub-packages."""
    public = {
        name
        for name, value in vars(flowrl).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= set(flowrl.__all__)


@pytest.mark.parametrize(
    "module",
    [flowrl.errors, flowrl.events, flowrl.hooks, flowrl.sched_hooks, flowrl.testing],
)
def test_submodule_all_is_sorted_and_resolves(module: types.ModuleType) -> None:
    # as ruff's RUF022 sorts it: constants (SCREAMING_CASE) first, then the rest
    assert list(module.__all__) == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.{name}"


@pytest.mark.parametrize(
    "cls",
    [
        flowrl.Hub,
        flowrl.Column,
        flowrl.Batch,
        flowrl.BatchMeta,
        flowrl.RaggedArray,
        flowrl.HubConfig,
        flowrl.HubKey,
    ],
    ids=lambda c: c.__name__,
)
def test_public_concrete_classes_are_final(cls: type) -> None:
    assert getattr(cls, "__final__", False) is True


def test_every_error_derives_from_flowrl_error() -> None:
    for name in flowrl.errors.__all__:
        assert issubclass(getattr(flowrl.errors, name), flowrl.FlowRLError), name


def test_import_does_not_load_torch() -> None:
    """Hub server processes import flowrl; torch would add seconds to their start-up."""
    import subprocess
    import sys

    code = (
        "import sys, flowrl, flowrl._launch.serve\n"
        "for name in flowrl.__all__: getattr(flowrl, name)\n"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
