"""Utilities for testing code built on flowrl, and for testing a hub itself.

``run_soak`` drives a multi-process hub with many concurrent clients for a bounded time
and accounts for every sample exactly: see :class:`SoakConfig` and :class:`SoakReport`
(``benchmarks/soak.py`` runs it from the command line).
"""

from flowrl.testing._soak import SOAK_COLUMNS, SOAK_TASKS, SoakConfig, SoakReport, account, run_soak

__all__ = ["SOAK_COLUMNS", "SOAK_TASKS", "SoakConfig", "SoakReport", "account", "run_soak"]
