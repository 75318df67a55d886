"""A shard's params and buffers in one flat fp32 buffer, lent to its replies without a copy.

A reply to a push or pull is the shard's state at one version, read after the shard's lock is released
(sent over gloo, or unpacked by the co-located worker). Copying the state into a buffer per reply cost one
memory pass per worker and reply (about 6 ms for a 64 MB shard on a 2-core machine, a tenth of its
push+pull). Instead a reply carries a view of the shard's buffer and a :class:`Loan`, and the buffer does
not change while a loan of it is out: before each write the shard calls :meth:`LentState.writable`,
which moves the state to a free buffer (one copy) when the current one is lent. So the replies of a sync
step to every worker share one buffer and cost no copy, a lone worker's push+pull none either, and an
async shard copies once per push only where a push arrives while an earlier reply is still being read.
A buffer goes back to the pool when its last loan is released (or dropped: a loan's finalizer releases it).
"""

from __future__ import annotations

import threading
import weakref

import torch


class _Buffer:
    """One state buffer and the number of loans of it that are out (its own lock: loans come back from
    whichever thread finished reading)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._lock = threading.Lock()
        self._loans = 0
        #: a reader may still read it after all (a send that failed to finish): never written again
        self.retired = False

    def take(self) -> None:
        with self._lock:
            self._loans += 1

    def give_back(self) -> None:
        with self._lock:
            self._loans -= 1

    @property
    def lent(self) -> bool:
        with self._lock:
            return self._loans > 0


class Loan:
    """A reader's hold on a state buffer: the shard writes there again only once every hold is released.

    :meth:`release` is idempotent; a loan that is dropped unreleased is released when it is collected.
    """

    def __init__(self, buffer: _Buffer) -> None:
        buffer.take()
        self._buffer = buffer
        self._release = weakref.finalize(self, buffer.give_back)
        self._release.atexit = False

    def release(self) -> None:
        self._release()

    def abandon(self) -> None:
        """Give the hold up without knowing that the reader is done (its send failed): the buffer is retired,
        never written again (the shard moves off it and drops it)."""
        self._buffer.retired = True
        self._release()

    @property
    def released(self) -> bool:
        return not self._release.alive


class LentState:
    """The flat fp32 state of one shard, kept in one of a few buffers (see the module docstring).

    Called only by its shard, under the shard's lock; only :class:`Loan` releases come from other threads.
    """

    def __init__(self, initial: torch.Tensor) -> None:
        if initial.dtype != torch.float32 or initial.dim() != 1 or not initial.is_contiguous():
            raise ValueError(
                "a shard's state is one contiguous flat float32 tensor, got "
                f"{initial.dtype} of shape {tuple(initial.shape)}{'' if initial.is_contiguous() else ', strided'}"
            )
        self._current = _Buffer(initial)
        self._spare: list[_Buffer] = []  # buffers once current: lent out, or free for the next move
        self.moves = 0  # how often a write found the state lent and moved it (one copy each)

    @property
    def data(self) -> torch.Tensor:
        """The current buffer: read it freely under the shard's lock; write it only after :meth:`writable`."""
        return self._current.data

    def lend(self) -> tuple[torch.Tensor, Loan]:
        """The current state and a loan that keeps it unchanged until released."""
        return self._current.data, Loan(self._current)

    def writable(self) -> bool:
        """Make the current buffer safe to write (call before every write).

        Returns True when the state moved to another buffer: views of the old one must be re-pointed.
        """
        if not self._current.lent and not self._current.retired:
            return False
        free = [b for b in self._spare if not b.lent and not b.retired]
        target = free[0] if free else _Buffer(torch.empty_like(self._current.data))
        target.data.copy_(self._current.data)
        # keep the lent buffers for reuse once they come back; at most one free spare (the one taken now);
        # retired ones are dropped
        kept = [b for b in [*self._spare, self._current] if b is not target and b.lent and not b.retired]
        self._spare = kept
        self._current = target
        self.moves += 1
        return True
