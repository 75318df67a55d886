"""What a worker's push carries besides its gradients: the fp64 "hyper" vector and its parts.

Layout: ``[max_grad_norm or -1, num_samples, push flags, *has-gradient mask words, *optimizer values]``.
The mask has one bit per parameter of the plan (whether the worker had a gradient for it), packed
:data:`MASK_BITS` to an fp64 word (exact integers). The optimizer values are the live hyperparameters of
the worker's optimizer (mirror.py). Nothing here is pickled: every value is a number.
"""

from __future__ import annotations

import torch

#: entries before the mask: [max_grad_norm or -1, num_samples, push flags]
HYPER_PREFIX = 3

#: bits of a push's has-gradient mask per fp64 word (exact: well below 53)
MASK_BITS = 32


class PushFlag:
    """Bits of the ``push flags`` entry of the hyper vector."""

    NONFINITE = 1  # the worker found a NaN/Inf in its push: every shard drops all of it
    DELTA = 2  # a local-update delta (delta_exchange.py), not a gradient: its own staleness rule


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


def decode_mask(words: list[float], num_params: int) -> list[bool]:
    ints = [int(w) for w in words]
    return [bool(ints[i // MASK_BITS] >> (i % MASK_BITS) & 1) for i in range(num_params)]


def nonfinite_in(data: torch.Tensor, ranges: list[tuple[int, int]], below: float | None = None) -> int | None:
    """Offset of the first range of ``data`` holding a NaN/Inf, else None (one pass when it is all finite).

    ``below``: also a finite value whose magnitude is not below it (one pass still: ``|x| < below`` is false
    for NaN and Inf too), for a wire whose format rounds such values to Inf.
    """
    for a, b in ranges:
        if b <= a:
            continue
        ok = torch.isfinite(data[a:b]) if below is None else data[a:b].abs() < below
        if not bool(ok.all()):
            return a
    return None
