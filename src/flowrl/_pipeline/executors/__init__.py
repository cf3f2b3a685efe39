"""Executors run a frozen :class:`~flowrl._pipeline.pipeline.Pipeline` against a hub."""
