"""How a shard's flat payload is cut into messages on the wire, so that large tensors travel in place.

A push's gradients and a reply's parameters would otherwise be copied into (out of) one contiguous
buffer per shard on every step: at 64 MB that is two memory passes of ~7 ms each on top of the ~50 ms
the transfers take. Instead the payload travels as *segments*: every fp32 parameter piece of at least
:data:`DIRECT_MIN` elements is a message of its own, sent straight from the worker's ``.grad`` and
received straight into the parameter; the pieces between them (small tensors, buffers, integer words)
go as one message each run, through the shard's reused buffer. A message costs about as much as copying
a megabyte (a thread hand-off in gloo on each side), hence the threshold: below it one copy is cheaper.

Both ends compute the same cut from the same plan (no sizes travel), so it is part of the wire format
(``messages.WIRE_VERSION``): a header flag (``Flag.SPLIT``) says a payload travels cut this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ivyplug.ps.sharding import Piece

#: elements of an fp32 parameter piece from which it travels as a message of its own (4 MB)
DIRECT_MIN = 1 << 20


@dataclass(frozen=True)
class Segment:
    """Words ``[start, end)`` of a shard's flat vector, sent as one message.

    ``piece``: the position (in the shard's piece list) of the one parameter piece it holds when it
    travels in place, else None (a run of small pieces, through the shard's buffer)."""

    start: int
    end: int
    piece: int | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


def wire_segments(pieces: Sequence[Piece]) -> list[Segment]:
    """The cut of a shard whose pieces (in flat-vector order) are ``pieces``; no segment is empty (a message of
    no bytes is never sent, so it must never be awaited either), so an empty shard has none."""
    out: list[Segment] = []
    run: int | None = None  # start of the current run of small pieces
    for i, p in enumerate(pieces):
        if p.kind == "param" and p.is_float and p.numel >= DIRECT_MIN:
            if run is not None and p.offset > run:
                out.append(Segment(run, p.offset))
            run = None
            out.append(Segment(p.offset, p.offset + p.numel, i))
        elif run is None:
            run = p.offset
    if run is not None and pieces:
        last = pieces[-1]
        if last.offset + last.numel > run:
            out.append(Segment(run, last.offset + last.numel))
    return out


def views(flat: torch.Tensor, segments: Sequence[Segment]) -> list[torch.Tensor]:
    """``flat`` cut as ``segments`` (views: receiving into them fills ``flat``)."""
    return [flat[s.start : s.end] for s in segments]
