"""Per-epoch queue of batch indices, served next to the shards (rank 0's PS, or an ``ivyplug serve``).

In async/ssp modes workers ask for their next batch instead of owning a fixed slice of the epoch, so a
fast worker processes more batches than a slow one (as TF's ClusterCoordinator hands steps to whichever
worker is free). Every index of an epoch is handed out at least once: exactly once while no worker is
lost; the batches a lost worker may not have finished (its last ``IN_FLIGHT`` indices: Lightning fetches
one batch ahead) go back to the queue, served before the next new index (:meth:`BatchQueue.release`).
"""

from __future__ import annotations

import threading

#: indices of a worker that may still be unfinished: the batch it trains and the one fetched ahead
IN_FLIGHT = 2


class BatchQueue:
    """Hands out ``0 .. num_batches-1`` once per epoch; a request for another epoch gets nothing."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.lock = threading.Lock()
        self.epoch = -1
        self.num_batches = 0
        self.next_index = 0
        self.taken: list[int] = [0] * num_workers
        self._in_flight: list[list[int]] = [[] for _ in range(num_workers)]
        self._returned: list[int] = []

    def reset(self, epoch: int, num_batches: int) -> None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches must be an int >= 0, got {num_batches!r}")
        with self.lock:
            self.epoch = epoch
            self.num_batches = num_batches
            self.next_index = 0
            self.taken = [0] * self.num_workers
            self._in_flight = [[] for _ in range(self.num_workers)]
            self._returned = []

    def take(self, worker: int, epoch: int) -> int:
        """Next index of ``epoch`` for ``worker``, or -1 when the epoch is exhausted (or not current).

        Asking again means the worker finished the batch before its previous one."""
        with self.lock:
            mine = self._in_flight[worker]
            del mine[: max(0, len(mine) - (IN_FLIGHT - 1))]
            if epoch != self.epoch:
                return -1
            if self._returned:
                index = self._returned.pop(0)
            elif self.next_index < self.num_batches:
                index = self.next_index
                self.next_index += 1
            else:
                return -1
            self.taken[worker] += 1
            mine.append(index)
            return index

    def release(self, worker: int) -> list[int]:
        """``worker`` is lost: the batches it may not have finished go back to the queue (returned)."""
        with self.lock:
            back, self._in_flight[worker] = self._in_flight[worker], []
            self._returned.extend(back)
            return back
