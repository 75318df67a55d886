"""``Coordinator``: what a job's workers share besides its shards: the batch queue, the stop flag, the rendezvous.

One object owns the three, so that a server loop asks one place for them and a worker's leaving changes them
together. Co-located servers: each rank's loop has a coordinator with its process's stop flag, and rank 0's
holds the batch queue (async/ssp dispatch). ``ivyplug serve`` (which dedicated servers run too): one
coordinator per job, with a :class:`Rendezvous` for the collectives of its live workers (Lightning's
``barrier``/``broadcast``/``reduce`` run on it, so a dead worker never hangs the others).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ivyplug.ps.server.batch_queue import BatchQueue
from ivyplug.ps.wire import typed_state
from ivyplug.ps.wire.transport import PSProtocolError


@dataclass
class Coordinator:
    """The batch queue (if this rank holds it), the stop flag and the rendezvous (an ``ivyplug serve``'s)."""

    queue: BatchQueue | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    rendezvous: Rendezvous | None = None

    def join_collectives(self, slot: int) -> None:
        """Worker ``slot`` joined (its shards know it): it counts in the collectives from now on."""
        if self.rendezvous is not None:
            self.rendezvous.join(slot)

    def rejoin_queue(self, slot: int) -> None:
        """Worker ``slot`` was admitted: it takes its place in the batch queue (a new worker, or one back in its
        old slot)."""
        if self.queue is not None:
            self.queue.rejoin(slot)

    def release(self, slot: int) -> tuple[list[int], list[int], int]:
        """Worker ``slot`` left: the batches it had not finished go back to the queue, before the collectives go
        on without it. Returns (batches back in the queue, batches left untrained this epoch, the epoch)."""
        back: list[int] = []
        late: list[int] = []
        epoch = -1
        if self.queue is not None:
            back, late = self.queue.release(slot)
            epoch = self.queue.epoch
        if self.rendezvous is not None:
            self.rendezvous.leave(slot)
        return back, late, epoch


class Rendezvous:
    """Collectives among a job's live workers (its own lock): round ``seq`` completes once every live
    worker contributed; a worker lost meanwhile no longer counts. Lightning's ``barrier``, ``broadcast``,
    ``reduce`` and the PS client's own collectives run on it, so a dead worker never hangs the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: set[int] = set()
        self._rounds: dict[int, dict[int, bytes]] = {}
        self._waiting: dict[int, list[Future[int]]] = {}
        self._results: dict[int, bytes] = {}

    def join(self, slot: int) -> None:
        with self._lock:
            if not self._members:  # a new run: its collectives count from 1 again
                self._rounds, self._waiting, self._results = {}, {}, {}
            self._members.add(slot)

    def leave(self, slot: int) -> None:
        with self._lock:
            self._members.discard(slot)
            done = [seq for seq in self._rounds if self._complete(seq)]
            ready = [self._finish(seq) for seq in done]
        self._resolve(ready)

    def gather(self, slot: int, seq: int, blob: bytes) -> Future[int]:
        """This worker's part of round ``seq``; the future gives the result's length once it completes."""
        fut: Future[int] = Future()
        with self._lock:
            if seq in self._results:
                raise PSProtocolError(f"worker {slot} joined collective {seq} after it completed")
            self._rounds.setdefault(seq, {})[slot] = blob
            self._waiting.setdefault(seq, []).append(fut)
            ready = [self._finish(seq)] if self._complete(seq) else []
        self._resolve(ready)
        return fut

    def result(self, seq: int) -> bytes:
        with self._lock:
            if seq not in self._results:
                raise PSProtocolError(f"collective {seq} has no result (not complete, or long gone)")
            return self._results[seq]

    def _complete(self, seq: int) -> bool:
        return self._members <= set(self._rounds[seq])

    def _finish(self, seq: int) -> tuple[list[Future[int]], int]:
        parts = self._rounds.pop(seq)
        slots = sorted(parts)
        blobs = [
            torch.frombuffer(bytearray(parts[s]), dtype=torch.uint8) if parts[s] else torch.zeros(0, dtype=torch.uint8)
            for s in slots
        ]
        self._results[seq] = typed_state.encode({"slots": slots, "blobs": blobs})
        for old in [k for k in self._results if k < seq - 2]:  # every live worker fetched those already
            del self._results[old]
        return self._waiting.pop(seq, []), len(self._results[seq])

    @staticmethod
    def _resolve(ready: list[tuple[list[Future[int]], int]]) -> None:
        for futures, size in ready:
            for fut in futures:
                if not fut.done():
                    fut.set_result(size)
