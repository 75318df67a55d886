"""Collectives of small values over the default process group, as uint8 tensors: nothing is unpickled.

``all_gather_object`` and object broadcasts unpickle what a peer sent, which runs code; a JSON document or
ivyplug's typed encoding (:mod:`ivyplug.ps.wire.typed_state`) in a byte tensor cannot. The values exchanged at
an epoch end (per-rank load records, the batch-size decision) are plain numbers, strings, lists and dicts, so
JSON holds them exactly (floats round-trip); what Lightning broadcasts (paths, numbers, tensors) fits the typed
encoding.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.wire import typed_state


def _device() -> torch.device:
    """Where the default group takes tensors: the current CUDA device under NCCL alone, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor on the device the default group takes."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return t.to(_device())


def _encode(value: Any) -> torch.Tensor:
    return _bytes_tensor(json.dumps(value, allow_nan=True, separators=(",", ":")).encode())


def _decode(t: torch.Tensor) -> Any:
    return json.loads(t.cpu().numpy().tobytes().decode())


def all_gather_json(value: Any, world_size: int) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), by rank."""
    mine = _encode(value)
    device = mine.device
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    parts = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return [_decode(p[: int(n)]) for p, n in zip(parts, sizes, strict=True)]


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (the others pass anything, e.g. None)."""
    mine = _encode(value) if dist.get_rank() == src else _bytes_tensor(b"")
    return _decode(_broadcast_bytes(mine, src))


def broadcast_typed(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (paths, numbers, containers, tensors: :func:`typed_state.encode`) on every rank,
    its tensors on the CPU. A value the encoding cannot hold is a ``ValueError`` on every rank, not a hang."""
    mine = typed_or_refusal(value, src) if dist.get_rank() == src else b""
    return from_typed_or_refusal(_broadcast_bytes(_bytes_tensor(mine), src).cpu().numpy().tobytes())


#: what a broadcast's source sends in place of a value the typed encoding cannot hold (no encoding starts so)
_REFUSED = b"\x00refused:"


def typed_or_refusal(value: Any, src: int, verb: str = "broadcast") -> bytes:
    """``value`` in the typed encoding, or, where it cannot be encoded, why (sent in its place, so that the other
    ranks fail too rather than wait for bytes never sent)."""
    try:
        return typed_state.encode(value)
    except Exception as exc:  # any failure is sent as the refusal
        return _REFUSED + f"cannot {verb} a {type(value).__name__} from rank {src} without pickle: {exc}".encode()


def from_typed_or_refusal(raw: bytes) -> Any:
    """The value :func:`typed_or_refusal` encoded, or its refusal as a ``ValueError``."""
    reason = refusal_in(raw)
    if reason is not None:
        raise ValueError(reason)
    return typed_state.decode(raw)


def refusal_in(raw: bytes) -> str | None:
    """Why :func:`typed_or_refusal` sent ``raw`` in place of a value, or ``None`` for an encoded value (a rank that
    does not decode what others sent still fails with them)."""
    return raw[len(_REFUSED) :].decode() if raw.startswith(_REFUSED) else None


def _broadcast_bytes(mine: torch.Tensor, src: int) -> torch.Tensor:
    """Rank ``src``'s byte tensor on every rank (its length first)."""
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device)
    dist.broadcast(size, src=src)
    data = mine if dist.get_rank() == src else torch.zeros(int(size), dtype=torch.uint8, device=mine.device)
    dist.broadcast(data, src=src)
    return data
