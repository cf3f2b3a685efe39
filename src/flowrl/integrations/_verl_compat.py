"""The verl version gate: the shims match verl's interfaces of one release exactly."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

__all__ = ["SUPPORTED_VERL", "check_verl_release", "require_verl"]

SUPPORTED_VERL = "0.9.1"
_INSTALL = "see docs/verl.md for the install line"


def require_verl() -> ModuleType:
    """The ``verl`` module, or an ImportError saying which version is needed and how."""
    try:
        verl = importlib.import_module("verl")
    except ImportError as exc:
        raise ImportError(
            f"flowrl.integrations.verl needs verl=={SUPPORTED_VERL}, which is not installed "
            f"({exc}); {_INSTALL}"
        ) from exc
    _check(getattr(verl, "__version__", "unknown"))
    return verl


def check_verl_release() -> None:
    """require_verl's check without importing verl (whose import already binds
    ``transfer_queue``): the installed distribution's version."""
    try:
        found = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ImportError(
            f"flowrl.integrations.verl needs verl=={SUPPORTED_VERL}, which is not installed; "
            f"{_INSTALL}"
        ) from exc
    _check(found)


def _check(found: str) -> None:
    if found != SUPPORTED_VERL:
        raise ImportError(
            f"flowrl.integrations.verl supports verl=={SUPPORTED_VERL} only, found verl "
            f"{found}: its DataProto and agent-loop interfaces differ between releases; "
            f"install verl=={SUPPORTED_VERL} ({_INSTALL})"
        )
