"""Reproducible benchmarks, installed as ``ivyplug.benchmarks`` and run by ``ivyplug bench NAME``."""


class SelectionError(ValueError):
    """A ``--select`` (or ``--quick`` beside it) that the benchmark cannot run, raised before any job starts; its
    message names the benchmark, the key and what is allowed (``ivyplug bench`` prints it and exits 2)."""
