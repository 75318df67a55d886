"""Whether a worker asks the batch queue for its next index while its current batch trains.

Under dynamic dispatch a worker asks for each batch after it trained the last one. Over loopback the answer
takes a fraction of a millisecond; over a slow link it waits behind the bulk transfers that share its gloo pair
(a push, a pull's reply; with ``overlap=True`` the background exchange), and the worker idles for it at every
batch. Asking one index ahead hides that wait, but the worker then holds one more unfinished index, which at
an epoch's end the others wait for if it is slow. So each epoch starts asking on demand, times its first
:data:`PROBE_ASKS` answers against the time the worker trains between them, and asks ahead for the rest of
the epoch only where an answer took more than :data:`WAIT_SHARE` of that time and more than :data:`MIN_WAIT`
(loopback answers on a busy machine take a few milliseconds at worst; across a slow link tens to hundreds).
"""

from __future__ import annotations

import statistics

#: answers timed at the start of each epoch before deciding
PROBE_ASKS = 3
#: ask ahead where the median answer takes more than this share of the median time between asks ...
WAIT_SHARE = 0.1
#: ... and more than this many seconds
MIN_WAIT = 0.005


class AskAhead:
    """Times a worker's requests to the batch queue and decides, per epoch, whether to ask one index ahead.

    Example:
        >>> from ivyplug.ps.worker.ask_ahead import AskAhead
        >>> ahead = AskAhead()
        >>> ahead.start_epoch()
        >>> for t in (0.0, 1.0, 2.0):  # answers of 0.3 s after 0.7 s of training each
        ...     ahead.answered(sent=t, received=t + 0.3)
        >>> ahead.enabled
        True
    """

    def __init__(
        self, probe_asks: int = PROBE_ASKS, wait_share: float = WAIT_SHARE, min_wait: float = MIN_WAIT
    ) -> None:
        if probe_asks < 2:
            raise ValueError(f"probe_asks must be an int >= 2 (a gap needs two answers), got {probe_asks!r}")
        if not wait_share >= 0.0:
            raise ValueError(f"wait_share must be a number >= 0, got {wait_share!r}")
        if not min_wait >= 0.0:
            raise ValueError(f"min_wait must be a number >= 0 (seconds), got {min_wait!r}")
        self.probe_asks, self.wait_share, self.min_wait = probe_asks, wait_share, min_wait
        #: asking ahead in this epoch (decided after its first ``probe_asks`` answers)
        self.enabled = False
        self._waits: list[float] = []
        self._gaps: list[float] = []
        self._last: float | None = None

    def start_epoch(self) -> None:
        """Ask on demand again and time the first answers of the new epoch."""
        self.enabled = False
        self._waits, self._gaps, self._last = [], [], None

    @property
    def deciding(self) -> bool:
        """Whether answers are still being timed in this epoch."""
        return len(self._waits) < self.probe_asks

    def answered(self, sent: float, received: float) -> None:
        """A request sent at ``sent`` was answered at ``received`` (``time.monotonic()`` seconds)."""
        if not self.deciding:
            return
        if self._last is not None:
            self._gaps.append(max(0.0, sent - self._last))
        self._waits.append(max(0.0, received - sent))
        self._last = received
        if not self.deciding:
            wait, gap = statistics.median(self._waits), statistics.median(self._gaps)
            self.enabled = wait > max(self.wait_share * gap, self.min_wait)
