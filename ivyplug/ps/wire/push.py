"""What a worker's push carries besides its gradients: the fp64 "hyper" vector and its parts.

Layout: ``[max_grad_norm or -1, num_samples, push flags, push number, clip_value or -1, *has-gradient mask words,
*optimizer values]`` (:func:`hyper_prefix` builds the part before the optimizer values). The two clips are sync
mode's, applied by the servers to the combined gradient.
The push number names the push on every shard (shards holding pieces of a split LAMB tensor match their
sums by it, server/split_trust.py): distinct across a worker's pushes and its restarts. The mask has one bit
per parameter of the plan (whether the worker had a gradient for it), packed :data:`MASK_BITS` to an fp64
word (exact integers). The optimizer values are the live hyperparameters of
the worker's optimizer (server/mirror.py). Nothing here is pickled: every value is a number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: entries before the mask: [max_grad_norm or -1, num_samples, push flags, push number, clip_value or -1]
HYPER_PREFIX = 5

#: bits of a push's has-gradient mask per fp64 word (exact: well below 53)
MASK_BITS = 32


class PushFlag:
    """Bits of the ``push flags`` entry of the hyper vector."""

    NONFINITE = 1  # the worker found a NaN/Inf in its push: every shard drops all of it
    DELTA = 2  # a local-update delta (localsgd/delta_exchange.py), not a gradient: its own staleness rule


def mask_words(num_params: int) -> int:
    """fp64 words that carry the has-gradient bits of ``num_params`` parameters."""
    return (num_params + MASK_BITS - 1) // MASK_BITS


def encode_mask(has_grad: list[bool]) -> list[float]:
    """Pack per-parameter has-gradient bits into fp64-exact integers (:data:`MASK_BITS` per word)."""
    words = [0] * mask_words(len(has_grad))
    for i, has in enumerate(has_grad):
        if has:
            words[i // MASK_BITS] |= 1 << (i % MASK_BITS)
    return [float(w) for w in words]


def hyper_prefix(
    has_grad: list[bool],
    num_samples: float = 1.0,
    flags: int = 0,
    push_number: int = 0,
    max_grad_norm: float = -1.0,
    clip_value: float = -1.0,
) -> torch.Tensor:
    """The hyper vector's entries before the optimizer values (fp64): the layout above."""
    head = [max_grad_norm, float(num_samples), float(flags), float(push_number), clip_value]
    return torch.tensor([*head, *encode_mask(has_grad)], dtype=torch.float64)


def decode_mask(words: list[float], num_params: int) -> list[bool]:
    ints = [int(w) for w in words]
    return [bool(ints[i // MASK_BITS] >> (i % MASK_BITS) & 1) for i in range(num_params)]


def nonfinite_in(data: torch.Tensor, ranges: list[tuple[int, int]], below: float | None = None) -> int | None:
    """Offset of the first range of ``data`` holding a NaN/Inf, else None (one pass when it is all finite).

    ``below``: also a finite value whose magnitude is not below it (one pass still), for a wire whose format
    rounds such values to Inf.

    Reductions, not ``isfinite(x).all()``: that writes a bool per element and reads it again, 20-35× the time
    of one read (a 64 MB push: ~200 ms against ~6 ms). A sum is finite only if every term is (NaN and Inf
    propagate through IEEE additions), so a finite sum clears a range in one read; only a non-finite sum,
    which finite values can also give by overflowing, is looked at exactly (min and max, NaN-propagating).
    """
    for a, b in ranges:
        if b <= a:
            continue
        part = data[a:b]
        if below is None and math.isfinite(float(part.sum())):
            continue
        low, high = (float(v) for v in torch.aminmax(part))
        limit = math.inf if below is None else below
        if not (-limit < low and high < limit):  # false for NaN, and for ±Inf
            return a
    return None


def nonfinite_in_parts(
    parts: Sequence[torch.Tensor], starts: Sequence[int], ranges: list[tuple[int, int]], below: float | None = None
) -> int | None:
    """:func:`nonfinite_in` over a payload cut into ``parts`` (part i holds the words from ``starts[i]``):
    an offset inside the first range that holds a NaN/Inf (where that range starts, or where a part of it
    starts), else None."""
    for part, start in zip(parts, starts, strict=True):
        end = start + part.numel()
        inside = [(max(a, start) - start, min(b, end) - start) for a, b in ranges if a < end and b > start]
        at = nonfinite_in(part, inside, below)
        if at is not None:
            return start + at
    return None


def squared_norm(data: torch.Tensor, chunk: int = 1 << 14) -> float:
    """Σ x² of a flat fp32 tensor, to ~1e-8 relative: fp32 dot products of ``chunk`` elements
    summed in float64. A float64 norm converts every element (~6× slower); one fp32 dot over a
    multi-MB tensor loses ~1e-4."""
    return float(sum(float(torch.dot(part, part)) for part in data.split(chunk))) if data.numel() else 0.0
