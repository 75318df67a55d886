"""A probe that replays a given load trace, for tests, demos and rehearsing a policy.

Each trace entry is a flat readings dict. Without a ``clock`` every ``read()`` returns the next
entry; with ``clock`` (a callable returning a step or epoch number) ``read()`` returns the entry at
that position, which ties the trace to training progress instead of to how often the sampler polls.
After the end the last entry is held, or the trace restarts with ``loop=True``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

from ivyplug.load.probe import Readings


class ScriptedProbe:
    """Replays ``trace`` (a list of readings dicts) read by read, or by ``clock()`` position."""

    def __init__(
        self,
        trace: Sequence[Mapping[str, float]],
        clock: Callable[[], int] | None = None,
        loop: bool = False,
        name: str = "scripted",
    ) -> None:
        if isinstance(trace, Mapping) or not isinstance(trace, Sequence) or len(trace) == 0:
            raise ValueError(f"trace must be a non-empty list of readings dicts, got {trace!r}")
        checked: list[Readings] = []
        for i, entry in enumerate(trace):
            if not isinstance(entry, Mapping):
                raise ValueError(f"trace[{i}] must be a dict of str -> float, got {entry!r}")
            row: Readings = {}
            for key, value in entry.items():
                if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"trace[{i}] must map str -> number, got {key!r}: {value!r}")
                if not math.isfinite(float(value)):
                    raise ValueError(f"trace[{i}][{key!r}] must be finite, got {value!r}")
                row[key] = float(value)
            checked.append(row)
        self.trace = checked
        self.clock = clock
        self.loop = loop
        self.name = name
        self._position = 0
        self._lock = threading.Lock()
        self.reads = 0

    def available(self) -> bool:
        return True

    def _index(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"clock() must return a non-negative position, got {position}")
        if self.loop:
            return position % len(self.trace)
        return min(position, len(self.trace) - 1)

    def read(self) -> Readings:
        with self._lock:
            self.reads += 1
            if self.clock is not None:
                return dict(self.trace[self._index(int(self.clock()))])
            entry = self.trace[self._index(self._position)]
            self._position += 1
            return dict(entry)

    def close(self) -> None:
        """Rewind to the start of the trace."""
        with self._lock:
            self._position = 0
