"""Out-of-memory recovery helpers: recognise an OOM and split a batch into micro-batches.

A batch is split along its first dimension: every leaf with a ``shape`` (torch tensors, NumPy and
TF arrays) is sliced, tuples/lists/dicts are split structurally, and other leaves (strings, numbers,
None) are copied into each part. Parts are as even as possible and keep the original order, so the
micro-batches together hold exactly the original samples. Nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_OOM_CLASS_NAMES = frozenset({"OutOfMemoryError", "ResourceExhaustedError"})


class OutOfMemoryRecoveryError(RuntimeError):
    """Splitting a batch did not get it through memory (the message says how far it went)."""


def is_oom_error(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, tf.errors.ResourceExhaustedError, or a RuntimeError saying 'out of memory'."""
    if any(cls.__name__ in _OOM_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()
    )


def part_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive pieces of ``total`` items, as even as possible, larger first."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    if parts > total:
        raise ValueError(f"cannot split a batch of {total} samples into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _leading(obj: Any) -> list[int]:
    shape = getattr(obj, "shape", None)
    if shape is not None and not isinstance(obj, (str, bytes)):
        if len(shape) == 0:
            return []
        return [int(shape[0])]
    if isinstance(obj, Mapping):
        return [n for v in obj.values() for n in _leading(v)]
    if isinstance(obj, (tuple, list)):
        return [n for v in obj for n in _leading(v)]
    return []


def batch_length(batch: Any) -> int:
    """The number of samples in ``batch`` (the shared first dimension of its array leaves)."""
    lengths = set(_leading(batch))
    if not lengths:
        raise ValueError("batch holds no array with a first dimension to split along")
    if len(lengths) > 1:
        raise ValueError(f"batch arrays disagree on their first dimension: {sorted(lengths)}")
    return lengths.pop()


def _slice(obj: Any, start: int, stop: int) -> Any:
    shape = getattr(obj, "shape", None)
    if shape is not None and not isinstance(obj, (str, bytes)) and len(shape) > 0:
        return obj[start:stop]
    if isinstance(obj, Mapping):
        return {k: _slice(v, start, stop) for k, v in obj.items()}
    if isinstance(obj, tuple):
        items = [_slice(v, start, stop) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_slice(v, start, stop) for v in obj]
    return obj


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` as ``parts`` consecutive micro-batches (see the module docstring)."""
    total = batch_length(batch)
    out = []
    start = 0
    for size in part_sizes(total, parts):
        out.append(_slice(batch, start, start + size))
        start += size
    return out


def next_split(parts: int, batch_size: int, max_parts: int) -> int:
    """The next number of parts to try after ``parts`` ran out of memory (doubling), or an error."""
    if parts >= min(max_parts, batch_size):
        raise OutOfMemoryRecoveryError(
            f"out of memory even after splitting a batch of {batch_size} samples into {parts} micro-batches "
            f"(limit max_parts={max_parts}); lower the batch size or free device memory"
        )
    return min(parts * 2, max_parts, batch_size)
