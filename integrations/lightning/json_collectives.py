"""Collectives of small JSON values over the default process group, as uint8 tensors.

``all_gather_object`` and object broadcasts unpickle what a peer sent, which runs code; a JSON document in
a byte tensor cannot. The values exchanged at an epoch end (per-rank load records, the batch-size
decision) are plain numbers, strings, lists and dicts, so JSON holds them exactly (floats round-trip).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _encode(value: Any) -> torch.Tensor:
    data = json.dumps(value, allow_nan=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(t.numpy().tobytes().decode())


def all_gather_json(value: Any, world_size: int) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), by rank."""
    mine = _encode(value)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return [_decode(p[: int(n)]) for p, n in zip(parts, sizes, strict=True)]


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (the others pass anything, e.g. None)."""
    mine = _encode(value) if dist.get_rank() == src else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src)
    data = mine if dist.get_rank() == src else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src)
    return _decode(data)
