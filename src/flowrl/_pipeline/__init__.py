"""Declaring and running pipelines: ``@stage`` specs, ``Pipeline``, executors, ``Loader``."""
