"""The consistency modes as policies a :class:`~ivyplug.ps.server.shard.Shard` holds, instead of branches on the
mode's name: what a push does, when a worker's reply may go out, where a joining worker's clock starts, and
what a reply that timed out was waiting for.

A policy keeps no state of its own: the clocks, versions and the step in progress are the shard's, and every
method is called by the shard with its lock held (the policy never takes a lock).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ivyplug.ps.server.shard import Shard


class ModePolicy(ABC):
    """What a mode decides for a shard (see the subclasses)."""

    name: ClassVar[str]
    #: a step cannot complete without every worker (a lost worker fails it)
    needs_every_worker: ClassVar[bool] = False

    @abstractmethod
    def take(
        self, shard: Shard, worker: int, grads: torch.Tensor, bufs: torch.Tensor, hyper: torch.Tensor, skipped: bool
    ) -> int:
        """Apply (or hold) ``worker``'s checked push; the staleness its reply reports."""

    @abstractmethod
    def is_ready(self, shard: Shard, worker: int) -> bool:
        """Whether ``worker``'s reply after its push may go out now."""

    def join_clock(self, shard: Shard) -> int:
        """The clock a worker that joins (or rejoins) starts at."""
        return shard.min_live_clock()

    def waiting_for(self, shard: Shard) -> str:
        """What a reply that is not ready waits for (the end of a timeout error)."""
        slow = [w for w in range(shard.num_workers) if shard.live[w] and shard.clock[w] == shard.min_live_clock()]
        return f"worker(s) {slow} to come within staleness {shard.cfg.staleness} (ssp)"


class SyncPolicy(ModePolicy):
    """Every worker's push of a step is held until all are in, then combined as one step
    (``Shard.combine_sync``); every reply waits for that step."""

    name = "sync"
    needs_every_worker = True

    def take(
        self, shard: Shard, worker: int, grads: torch.Tensor, bufs: torch.Tensor, hyper: torch.Tensor, skipped: bool
    ) -> int:
        shard.hold_sync_push(worker, grads, bufs, hyper, skipped)
        return 0

    def is_ready(self, shard: Shard, worker: int) -> bool:
        return shard.version >= shard.clock[worker]

    def join_clock(self, shard: Shard) -> int:
        return shard.version

    def waiting_for(self, shard: Shard) -> str:
        return shard.sync_wait()


class AsyncPolicy(ModePolicy):
    """Each push is applied on arrival, its step scaled for its staleness; its reply goes at once."""

    name = "async"

    def take(
        self, shard: Shard, worker: int, grads: torch.Tensor, bufs: torch.Tensor, hyper: torch.Tensor, skipped: bool
    ) -> int:
        return shard.apply_push(worker, grads, bufs, hyper, skipped)

    def is_ready(self, shard: Shard, worker: int) -> bool:
        return True


class SspPolicy(AsyncPolicy):
    """As async, but a worker's reply waits while it is more than ``staleness`` pushes ahead of the slowest live
    worker (stale synchronous parallel)."""

    name = "ssp"

    def is_ready(self, shard: Shard, worker: int) -> bool:
        assert shard.cfg.staleness is not None
        return shard.clock[worker] - shard.min_live_clock() <= shard.cfg.staleness


#: mode name -> its policy
POLICIES: dict[str, type[ModePolicy]] = {p.name: p for p in (SyncPolicy, AsyncPolicy, SspPolicy)}


def policy_for(mode: str) -> ModePolicy:
    """The policy of ``mode`` (ValueError listing the modes otherwise)."""
    try:
        return POLICIES[mode]()
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(POLICIES)}, got {mode!r}") from None
