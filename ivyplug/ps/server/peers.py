"""Server-to-server messages: a shard reaches the other shards of its job through these, not through the
endpoints a worker reaches them with (the worker's side of the wire carries only a worker's requests).

In sync mode every shard sends its part of the combined gradient's squared norm to every other shard before
it clips (docs/design.md "Gradient clipping"), and the sums of squares of its pieces of split LAMB tensors to
the shards holding their other pieces (split_trust.py). Shards of one process (dedicated servers, an ``ivyplug serve``)
call each other (a :class:`~ivyplug.ps.server.shard.Shard` is its own peer); co-located shards, one per
worker rank, send a NORM message over the job's channel to the rank that serves the other shard, whose server
loop hands it to its shard.
"""

from __future__ import annotations

import torch

from ivyplug.ps.wire.messages import Header, Kind
from ivyplug.ps.wire.transport import Channel


class WirePeer:
    """Shard ``shard``, served by rank ``shard`` of ``channel``'s group (co-located topology)."""

    def __init__(self, channel: Channel, shard: int) -> None:
        self.channel = channel
        self.shard = shard

    def norm(self, step: int, shard: int, sq: float) -> None:
        """Tell this peer that ``shard``'s squared norm at sync step ``step`` is ``sq`` (does not wait)."""
        h = Header(kind=Kind.NORM, sender=self.channel.rank, shard=self.shard, arg0=step, arg1=shard)
        self.channel.send(self.shard, h, None, torch.tensor([sq], dtype=torch.float64), wait=False)

    def trust_sums(self, key: tuple[int, int], shard: int, values: list[float]) -> None:
        """Tell this peer ``shard``'s sums of squares of its split LAMB pieces for update ``key`` (does not wait)."""
        worker, number = key
        h = Header(
            kind=Kind.TRUST_SUMS, sender=self.channel.rank, shard=self.shard, arg0=number, arg1=shard, arg2=worker
        )
        self.channel.send(self.shard, h, None, torch.tensor(values, dtype=torch.float64), wait=False)
