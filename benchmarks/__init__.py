"""Reproducible benchmarks, installed as ``ivyplug.benchmarks`` and run by ``ivyplug bench NAME``."""

from __future__ import annotations


class SelectionError(ValueError):
    """A ``--select`` (or ``--quick`` beside it) that the benchmark cannot run, raised before any job starts; its
    message names the benchmark, the key and what is allowed (``ivyplug bench`` prints it and exits 2)."""


def selected_numbers(bench: str, select: dict[str, list[str]], key: str, default: list[str], kind: type) -> list:
    """The values of ``key`` in a ``--select`` (``default`` where it is not named) as ``kind`` (int or float)."""
    values = select.get(key, default)
    try:
        return [kind(v) for v in values]
    except ValueError:
        raise SelectionError(f"bench {bench}: {key} takes {kind.__name__} values, got {values!r}") from None
