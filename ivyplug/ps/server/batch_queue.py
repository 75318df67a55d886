"""Per-epoch queue of batch indices, served next to the shards (rank 0's PS, or an ``ivyplug serve``).

In async/ssp modes workers ask for their next batch instead of owning a fixed slice of the epoch, so a
fast worker processes more batches than a slow one (as TF's ClusterCoordinator hands steps to whichever
worker is free). Every index of an epoch is trained at least once, also when a worker is lost:

* the first ``reserved`` indices belong one to each worker (index ``w`` to worker ``w``, so no worker ends an
  epoch empty-handed); the others are handed out in order to whoever asks;
* every request says how many of its batches the worker has finished (trained and pushed), so the queue
  knows which of the indices it handed out may still be unfinished, however far ahead the data loader
  fetched; a lost worker's unfinished indices, its reserved one included, go back to the queue
  (:meth:`BatchQueue.release`) and are handed out before the next new index;
* the queue tells a worker that the epoch is over only when no other live worker that is still training
  holds an unfinished index: until then the request waits (its reply is a future), because that worker may
  still be lost and its indices come back. A worker reports the end of its epoch with
  :meth:`BatchQueue.finish`. Workers that are themselves waiting do not make others wait (two workers
  waiting for each other would never be answered).

A worker that reaches the fit's step limit (Lightning's ``max_steps``) stops the epoch (:meth:`BatchQueue.stop`):
the queue hands out nothing more and answers every request, waiting ones included, with the epoch's end, so
each worker ends its epoch after the batches it already holds.

While no worker is lost, every index is handed out exactly once. What is left uncovered: a worker lost in
its epoch's last batches, after every other worker was told the epoch is over (they asked while it was
waiting itself); :meth:`BatchQueue.release` then returns the indices it gives back too late, and whoever
serves the queue reports them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

#: the answer to a request that would have to wait (``take(..., wait=False)``)
WAIT = -2


def check_count(name: str, value: object) -> None:
    """``value`` must be an int >= 0 (ValueError naming ``name`` and the value otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_epoch(num_batches: object, reserved: object, workers: int) -> None:
    """The arguments of an epoch's start: counts, and at most one reserved index per worker and per batch."""
    check_count("num_batches", num_batches)
    check_count("reserved", reserved)
    assert isinstance(num_batches, int) and isinstance(reserved, int)
    if reserved > min(num_batches, workers):
        raise ValueError(f"reserved must be at most min(num_batches={num_batches}, workers={workers}), got {reserved}")


class BatchQueue:
    """Hands out ``0 .. num_batches-1`` once per epoch (again where a lost worker left one unfinished)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.lock = threading.Lock()
        self.epoch = -1
        self.num_batches = 0
        self.next_index = 0
        self.taken: list[int] = [0] * num_workers
        self._handed: list[list[int]] = [[] for _ in range(num_workers)]  # this epoch's indices, in order
        self._finished: list[int] = [0] * num_workers  # how many of them the worker has finished
        self._told: set[int] = set()  # workers told that the epoch is over: they ask no more
        self._done: set[int] = set()  # workers that finished every index they were given (or are lost)
        self._returned: list[int] = []
        self._lost: set[int] = set()
        self._waiting: list[tuple[int, Future[int]]] = []  # (worker, reply) of requests that must wait
        self.stopped_by: int | None = None  # the worker that stopped this epoch (stop())

    def reset(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        """Start ``epoch`` with ``num_batches`` indices, the first ``reserved`` one per worker."""
        check_epoch(num_batches, reserved, self.num_workers)
        with self.lock:
            stale, self._waiting = self._waiting, []
            self.epoch = epoch
            self.num_batches = num_batches
            self.next_index = reserved
            self.taken = [0] * self.num_workers
            self._handed = [[w] if w < reserved and w not in self._lost else [] for w in range(self.num_workers)]
            self._finished = [0] * self.num_workers
            self._told = set(self._lost)
            self._done = set(self._lost)
            self._returned = [w for w in range(reserved) if w in self._lost]
            self.stopped_by = None
        for _, fut in stale:  # a request of an epoch that is over gets nothing
            fut.set_result(-1)

    def take(self, worker: int, epoch: int, finished: int = 0, wait: bool = True) -> Future[int]:
        """The next index of ``epoch`` for ``worker``, or -1 when the epoch is over, stopped or not current.

        ``finished``: how many of the indices this epoch handed to ``worker`` (its reserved one first) it has
        finished. The future is resolved at once unless the queue is empty while another worker still holds
        an unfinished index; then it waits until that one finishes or is lost — or, with ``wait=False``, is
        resolved with :data:`WAIT` (the worker first leaves the SSP clock, then asks again with ``wait=True``:
        a worker blocked here must not hold back one blocked by its clock).
        """
        check_count("finished", finished)
        fut: Future[int] = Future()
        with self.lock:
            if epoch != self.epoch:
                index: int | None = -1
            else:
                self._finished[worker] = max(self._finished[worker], min(finished, len(self._handed[worker])))
                index = self._next(worker, {w for w, _ in self._waiting})
                if index is None and not wait:
                    index = WAIT
                elif index is None:
                    self._waiting.append((worker, fut))
            ready = self._resolvable()
        if index is not None:
            fut.set_result(index)
        self._resolve(ready)
        return fut

    def stop(self, worker: int, epoch: int) -> None:
        """``worker`` reached the fit's step limit: nothing more is handed out in ``epoch``.

        Every request from now on, and every waiting one, is answered -1 (the epoch is over); the batches
        already handed out are trained by whoever holds them. A stop of an epoch that is not current does nothing.
        """
        with self.lock:
            if epoch == self.epoch and self.stopped_by is None:
                self.stopped_by = worker
                self._returned = []
                self.next_index = self.num_batches
            ready = self._resolvable()
        self._resolve(ready)

    def finish(self, worker: int, epoch: int) -> None:
        """``worker`` has trained every index it was given in ``epoch`` and asks for none more this epoch."""
        with self.lock:
            if epoch == self.epoch:
                self._finished[worker] = len(self._handed[worker])
                self._told.add(worker)
                self._done.add(worker)
            ready = self._resolvable()
        self._resolve(ready)

    def release(self, worker: int) -> tuple[list[int], list[int]]:
        """``worker`` is lost: the indices it may not have finished go back to the queue.

        Returns them, and those of the queue's returned indices that no live worker will ask for any more
        this epoch (every other one was told the epoch is over): these stay untrained in this epoch.
        """
        with self.lock:
            back = self._handed[worker][self._finished[worker] :]
            self._handed[worker] = []
            self._finished[worker] = 0
            self._told.add(worker)
            self._done.add(worker)
            self._lost.add(worker)
            self._returned.extend(back)
            gone = [fut for w, fut in self._waiting if w == worker]  # its own request gets nothing
            self._waiting = [(w, fut) for w, fut in self._waiting if w != worker]
            ready = [(fut, -1) for fut in gone] + self._resolvable()
            asking = any(w not in self._told for w in range(self.num_workers)) or bool(self._waiting)
            late = [] if asking else list(self._returned)
        self._resolve(ready)
        return back, late

    def rejoin(self, worker: int) -> None:
        """``worker``'s slot is live again (a restarted worker): its reserved index is its own from the next epoch."""
        with self.lock:
            self._lost.discard(worker)

    def unfinished(self, worker: int) -> list[int]:
        """The indices ``worker`` holds that it has not reported finished."""
        with self.lock:
            return list(self._handed[worker][self._finished[worker] :])

    # -- under the lock ---------------------------------------------------------------------------
    def _next(self, worker: int, waiting: set[int]) -> int | None:
        """An index for ``worker``; -1 when the epoch is over for it; None when it must wait."""
        if self.stopped_by is not None:
            self._told.add(worker)
            return -1
        if self._returned:
            index = self._returned.pop(0)
        elif self.next_index < self.num_batches:
            index = self.next_index
            self.next_index += 1
        elif self._held_elsewhere(worker, waiting):
            return None
        else:
            self._told.add(worker)
            return -1
        self.taken[worker] += 1
        self._handed[worker].append(index)
        return index

    def _held_elsewhere(self, worker: int, waiting: set[int]) -> bool:
        """Whether another live worker that is still training (not waiting itself) may give an index back."""
        return any(
            w != worker and w not in self._done and w not in waiting and len(self._handed[w]) > self._finished[w]
            for w in range(self.num_workers)
        )

    def _resolvable(self) -> list[tuple[Future[int], int]]:
        """Waiting requests that can be answered now (removed from the waiting list)."""
        ready: list[tuple[Future[int], int]] = []
        still: list[tuple[int, Future[int]]] = []
        waiting = {w for w, _ in self._waiting}
        for worker, fut in self._waiting:
            waiting.discard(worker)
            index = self._next(worker, waiting)
            if index is None:
                still.append((worker, fut))
                waiting.add(worker)
            else:
                ready.append((fut, index))
        self._waiting = still
        return ready

    @staticmethod
    def _resolve(ready: list[tuple[Future[int], int]]) -> None:
        for fut, index in ready:  # after the lock is released: a callback may send a reply
            fut.set_result(index)
