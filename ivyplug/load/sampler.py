"""Polls probes on a background thread, so NVML's driver lock and syscalls never touch a training step.

The training thread only takes a lock and copies a small dict (``latest()``, ``summary()``). The
window statistics (mean, max, last, count per key since ``reset_window()``) let epoch-level
decisions use the whole epoch: mean utilisation, peak memory.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ivyplug.load.probe import Probe, Readings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stat:
    """Summary of one key over a window."""

    mean: float
    max: float
    min: float
    last: float
    count: int


class _Acc:
    __slots__ = ("count", "last", "max", "min", "total")

    def __init__(self, value: float) -> None:
        self.total = value
        self.max = value
        self.min = value
        self.last = value
        self.count = 1

    def add(self, value: float) -> None:
        self.total += value
        self.max = max(self.max, value)
        self.min = min(self.min, value)
        self.last = value
        self.count += 1


class Sampler:
    """Reads ``probes`` every ``interval`` seconds on a daemon thread; ``close()`` stops it.

    A probe whose ``read()`` raises is logged once and skipped from then on; a probe that is not
    ``available()`` is never polled.
    """

    def __init__(self, probes: Iterable[Probe], interval: float = 1.0, start: bool = True) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if not math.isfinite(float(interval)):
            raise ValueError(f"interval must be finite, got {interval!r}")
        self.interval = float(interval)
        self.probes: list[Probe] = list(probes)
        for p in self.probes:
            if not isinstance(p, Probe):
                raise ValueError(f"probes must implement ivyplug.load.Probe (name, available, read, close), got {p!r}")
        self._active = [p for p in self.probes if p.available()]
        self._lock = threading.Lock()
        self._latest: Readings = {}
        self._window: dict[str, _Acc] = {}
        self._generation = 0  # bumped by reset_window(): a read begun before it belongs to the window before
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.sample_thread_ids: set[int] = set()
        if start:
            self.start()

    @property
    def active_probes(self) -> list[Probe]:
        """The probes that reported themselves available and have not failed."""
        return list(self._active)

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ivyplug-load-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_now()
            self._stop.wait(self.interval)

    def sample_now(self) -> Readings:
        """Read every active probe once (on the calling thread) and fold the result into the window.

        A read that began before the last ``reset_window()`` updates ``latest()`` only: it describes the window
        before (the last epoch's memory peak must not open the next epoch's window)."""
        with self._lock:
            generation = self._generation
        merged: Readings = {}
        for probe in list(self._active):
            try:
                merged.update(probe.read())
            except Exception as exc:  # a broken probe must not take training down
                log.warning("ivyplug: probe %r failed and is disabled: %r", getattr(probe, "name", probe), exc)
                self._active = [p for p in self._active if p is not probe]
        with self._lock:
            self.samples += 1
            self.sample_thread_ids.add(threading.get_ident())
            self._latest.update(merged)
            if generation != self._generation:
                return merged
            for key, value in merged.items():
                acc = self._window.get(key)
                if acc is None:
                    self._window[key] = _Acc(value)
                else:
                    acc.add(value)
        return merged

    def latest(self) -> Readings:
        """The most recent value of every key seen so far."""
        with self._lock:
            return dict(self._latest)

    def summary(self) -> dict[str, Stat]:
        """Mean, max, min, last and count of every key since the last ``reset_window()``."""
        with self._lock:
            return {k: Stat(a.total / a.count, a.max, a.min, a.last, a.count) for k, a in self._window.items()}

    def reset_window(self) -> None:
        """Start a new statistics window (for example at the start of an epoch)."""
        with self._lock:
            self._window.clear()
            self._generation += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the probes; raises if the thread does not stop within ``timeout``."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError(f"ivyplug load sampler did not stop within {timeout} s (a probe read is stuck)")
        self._thread = None
        for probe in self.probes:
            try:
                probe.close()
            except Exception as exc:
                log.debug("closing probe %r failed: %r", getattr(probe, "name", probe), exc)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
