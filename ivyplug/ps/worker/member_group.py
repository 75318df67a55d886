"""Collectives among a job's live workers, through its ``ivyplug serve`` (server/coordinator.py's ``Rendezvous``).

The twin of worker_group.py for jobs whose servers live outside the workers (``servers=`` or
``num_servers=k``): the same calls, but a worker that dies leaves the group instead of hanging everyone in
a gloo collective that waits for it. Each call is one round on the service: every live worker sends its
bytes, the round completes when the last live one did, and each gets everyone's parts back. Results hold
only the workers that took part; a worker missing from a round where it took part before is reported once,
by rank, with a warning.
"""

from __future__ import annotations

import logging

import torch

from ivyplug.ps.server.endpoints import WireEndpoint, WireStats
from ivyplug.ps.wire import typed_state
from ivyplug.ps.wire.messages import Kind, bytes_to_words, words_to_bytes
from ivyplug.ps.wire.transport import PSProtocolError
from ivyplug.ps.worker.service_link import ServiceLink

log = logging.getLogger(__name__)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bytes_tensor(raw: bytes, like: torch.Tensor) -> torch.Tensor:
    """``raw`` (from :func:`tensor_bytes`) as a tensor of ``like``'s dtype and shape (ValueError if it does not fit)."""
    if len(raw) != like.numel() * like.element_size():
        raise ValueError(f"a peer's tensor has {len(raw)} bytes, expected {like.numel() * like.element_size()}")
    if not raw:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


class MemberGroup:
    """Collectives among the live workers of a service's job; ranks are the workers' slots."""

    def __init__(self, link: ServiceLink, rank: int, world_size: int, timeout: float, stats: WireStats) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._endpoint = WireEndpoint(link.channel, 0, -1, 0, stats)
        self._seq = 0
        self.live: list[int] = list(range(world_size))
        self.lost: list[int] = []

    def gather(self, blob: bytes, what: str, *, fetch: bool = True) -> dict[int, bytes]:
        """Every live worker's ``blob``, by rank (this worker's included); ``fetch=False``: send it, receive
        nothing (the round still waits for every live worker; an empty dict)."""
        self._seq += 1
        ep = self._endpoint
        words = bytes_to_words(blob)
        size = ep.request(Kind.GATHER, words, arg0=len(blob), arg1=self._seq, what=what).header(self.timeout).arg0
        if not fetch:  # the service drops a round's result two rounds later, fetched or not
            return {}
        _, out = ep.request(
            Kind.GATHER_FETCH, reply_numel=(size + 3) // 4, arg0=size, arg1=self._seq, what=what
        ).payload(self.timeout)
        result = typed_state.decode(words_to_bytes(out, size) if out is not None else b"")
        parts = {int(s): b.numpy().tobytes() for s, b in zip(result["slots"], result["blobs"], strict=True)}
        gone = [r for r in self.live if r not in parts]
        if gone:
            self.lost += gone
            log.warning(
                "ivyplug PS: rank(s) %s left the job (lost while %s); it goes on with rank(s) %s",
                gone,
                what,
                sorted(parts),
            )
        self.live = sorted(parts)
        return parts

    def barrier(self, what: str) -> None:
        self.gather(b"", what)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Rank 0's ``tensor`` to every live worker, in place."""
        mine = tensor_bytes(tensor) if self.rank == 0 else b""
        parts = self.gather(mine, what)
        if 0 not in parts:
            raise PSProtocolError(f"rank 0 is gone: nothing to broadcast ({what})")
        if self.rank != 0:
            tensor.copy_(bytes_tensor(parts[0], tensor))

    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every live worker's ``tensor`` (same shape and dtype), in rank order."""
        parts = self.gather(tensor_bytes(tensor), what)
        return [bytes_tensor(parts[r], tensor) for r in sorted(parts)]

    def share_all(self, blob: bytes) -> list[bytes]:
        parts = self.gather(blob, "sharing checkpoint shards")
        return [parts[r] for r in sorted(parts)]

    def gather_to_rank0(self, blob: bytes, what: str) -> dict[int, bytes] | None:
        """Every live worker's ``blob`` on rank 0, by rank; ``None`` on the others, which fetch nothing."""
        parts = self.gather(blob, what, fetch=self.rank == 0)
        return parts if self.rank == 0 else None

    def share_from_rank0(self, blobs: list[bytes], count: int) -> list[bytes]:
        """Rank 0's ``count`` byte strings to every live worker."""
        mine = (
            typed_state.encode(
                [
                    torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
                    for b in blobs
                ]
            )
            if self.rank == 0
            else b""
        )
        parts = self.gather(mine, "rank 0's checkpoint shards")
        if 0 not in parts:
            raise PSProtocolError("rank 0 is gone: it holds the checkpoint shards")
        out = [t.numpy().tobytes() for t in typed_state.decode(parts[0])]
        if len(out) != count:
            raise PSProtocolError(f"rank 0 shared {len(out)} checkpoint shards, expected {count}")
        return out

    def close(self) -> None:
        """Nothing to release: the pair belongs to the client's link."""
