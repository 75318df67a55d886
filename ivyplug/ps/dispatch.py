"""Per-epoch queue of batch indices, served by rank 0's PS next to the shards.

In async/ssp modes workers ask for their next batch instead of owning a fixed slice of the epoch, so a
fast worker processes more batches than a slow one (as TF's ClusterCoordinator hands steps to whichever
worker is free). Every index of an epoch is handed out exactly once.
"""

from __future__ import annotations

import threading


class BatchQueue:
    """Hands out ``0 .. num_batches-1`` once per epoch; a request for another epoch gets nothing."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.lock = threading.Lock()
        self.epoch = -1
        self.num_batches = 0
        self.next_index = 0
        self.taken: list[int] = [0] * num_workers

    def reset(self, epoch: int, num_batches: int) -> None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches must be an int >= 0, got {num_batches!r}")
        with self.lock:
            self.epoch = epoch
            self.num_batches = num_batches
            self.next_index = 0
            self.taken = [0] * self.num_workers

    def take(self, worker: int, epoch: int) -> int:
        """Next index of ``epoch`` for ``worker``, or -1 when the epoch is exhausted (or not current)."""
        with self.lock:
            if epoch != self.epoch or self.next_index >= self.num_batches:
                return -1
            index = self.next_index
            self.next_index += 1
            self.taken[worker] += 1
            return index
