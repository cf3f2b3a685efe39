"""Observers of the hub's event stream that the package ships (fail-soft hooks)."""
