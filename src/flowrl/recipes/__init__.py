"""Ready-to-run jobs (``flowrl run NAME``)."""
