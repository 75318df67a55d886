"""``sync_every="auto"``: the number of local steps between two exchanges, chosen from measured times.

A worker measures the wall time of its local steps (from the end of one step to the end of the next, an
exchange inside left out: data loading, forward, backward and the inner update) and of its exchanges (push,
merge, pull). Without overlap an exchange stalls the local steps, so it costs ``T_x / (H * T_s + T_x)`` of the
time; the period is the smallest H that keeps that share at most :data:`COMM_SHARE`:

    H = ceil(T_x * (1 - COMM_SHARE) / (COMM_SHARE * T_s)),  clamped to [MIN_H, MAX_H],

with ``T_s`` and ``T_x`` the medians of the last :data:`WINDOW` steps and exchanges. With overlap ``T_x`` is
an exchange's whole time on its background thread (push, merge, pull), not the wait it leaves to the training
thread: by the same rule an exchange then finishes well within the H steps it overlaps, and its CPU cost
(encoding, the servers' step, on cores the local steps share) stays within the same share. Chosen from the
wait instead, H fell to 1-2 on two emulated hosts and the background exchanges, always busy, slowed the steps
they were meant to hide under (an epoch 2.7x longer than with H = 16). It starts at
:data:`START_H`, is first chosen after :data:`FIRST_EXCHANGES` exchanges (the first pays start-up costs), and
again whenever :meth:`SyncPeriod.retune` is called (at each epoch's end under Lightning).

Each worker chooses from its own times, so a worker whose steps take 3x longer takes about a third of the
steps per exchange, and exchanges arrive about evenly in time from fast and slow workers (the dynamic local
updates of asynchronous Local-SGD, arXiv 2401.09135). A delta is the progress of the steps it holds, so a
delta of fewer steps is smaller: in async/ssp merges it weighs by its steps without a weight of its own; in
sync mode the servers weight each delta by its local steps (``PSClient.step(num_samples=local_steps)``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

#: the largest share of a worker's time that exchanges may take
COMM_SHARE = 0.1
MIN_H, MAX_H = 1, 256
START_H = 4
FIRST_EXCHANGES = 3
WINDOW = 64

SyncEvery = int | Literal["auto"]


def check_sync_period(value: object) -> SyncEvery:
    """An int >= 1 or ``"auto"`` (ValueError naming ``sync_every`` otherwise)."""
    if value == "auto" and isinstance(value, str):
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"sync_every must be an int >= 1 (local steps between exchanges) or 'auto' (chosen from the measured "
            f"step and exchange times), got {value!r}"
        )
    return value


def period_for(step_seconds: float, exchange_seconds: float, share: float = COMM_SHARE) -> int:
    """The smallest H in [MIN_H, MAX_H] for which exchanges take at most ``share`` of the time."""
    if not step_seconds > 0:  # no measurable step: exchange as rarely as allowed
        return MAX_H
    h = math.ceil(max(exchange_seconds, 0.0) * (1 - share) / (share * step_seconds) - 1e-9)
    return min(MAX_H, max(MIN_H, h))


class SyncPeriod:
    """The current H of one worker: fixed, or chosen from its measured step and exchange times (``"auto"``)."""

    def __init__(self, sync_every: SyncEvery, clock: Callable[[], float] = time.perf_counter) -> None:
        self.auto = check_sync_period(sync_every) == "auto"
        self.value = START_H if self.auto else int(sync_every)
        self._clock = clock
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._exchanges: deque[float] = deque(maxlen=WINDOW)
        self._last_end: float | None = None
        self._exchanging_since: float | None = None
        self._seen_exchanges = 0

    @property
    def setting(self) -> SyncEvery:
        """What the user asked for: the fixed H, or ``"auto"``."""
        return "auto" if self.auto else self.value

    def step_ended(self, steps: int = 1) -> None:
        """``steps`` local steps ended since the last call (Keras runs ``steps_per_execution`` in one call; call
        after the inner step, before a possible exchange)."""
        if not self.auto:
            return
        now = self._clock()
        if self._last_end is not None:
            self._steps.append((now - self._last_end) / steps)
        self._last_end = now

    def exchange_started(self) -> None:
        if self.auto:
            self._exchanging_since = self._clock()

    def exchange_ended(self, seconds: float | None = None) -> None:
        """An exchange ended: its time is measured and kept out of the next step's.

        ``seconds``: the exchange's time measured elsewhere (an overlapped exchange's whole time on its
        background thread), counted instead of the wall time since :meth:`exchange_started`.
        """
        if not self.auto or self._exchanging_since is None:
            return
        now = self._clock()
        self._exchanges.append(now - self._exchanging_since if seconds is None else seconds)
        self._exchanging_since = None
        self._last_end = now
        self._seen_exchanges += 1
        if self._seen_exchanges == FIRST_EXCHANGES:
            self.retune()

    def pause(self) -> None:
        """Time until the next step is not a step's (validation, a checkpoint): the next interval is not counted."""
        self._last_end = None

    def retune(self) -> int:
        """Choose H again from the medians of the recent times (``"auto"`` only); returns the current H."""
        if self.auto and self._steps and self._exchanges:
            self.value = period_for(statistics.median(self._steps), statistics.median(self._exchanges))
        return self.value
