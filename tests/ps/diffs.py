"""Comparing lists of tensors or arrays in tests without losing a NaN (numpy only: no torch import).

Python's builtin ``max`` over per-tensor floats drops a NaN in any element but the first (``nan > x`` is
false, so it keeps the value it has); ``np.max`` over the per-tensor maxima propagates it, and a NaN then
fails every ``<=`` or ``>`` bound a test applies to the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def as_float64(x: Any) -> np.ndarray:
    """A float64 numpy copy of a torch tensor (any device or dtype), numpy array, Keras variable or list."""
    if hasattr(x, "detach"):  # a torch tensor (bfloat16 has no numpy dtype: go through float64 first)
        x = x.detach().cpu().double().numpy()
    elif hasattr(x, "numpy"):  # a Keras/TF variable or tensor
        x = x.numpy()
    return np.array(x, dtype=np.float64)


def max_abs_diff(a: Iterable[Any], b: Iterable[Any]) -> float:
    """Largest ``|x - y|`` over pairs of equally shaped tensors, in float64; NaN if any difference is NaN."""
    xs, ys = list(a), list(b)
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} tensors against {len(ys)}")
    if not xs:
        raise ValueError("no tensors to compare")
    per_tensor = np.zeros(len(xs))
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        fx, fy = as_float64(x), as_float64(y)
        if fx.shape != fy.shape:  # no silent broadcasting
            raise ValueError(f"tensor {i}: shape {fx.shape} against {fy.shape}")
        if fx.size:
            with np.errstate(invalid="ignore"):  # inf - inf: NaN is the answer, not a warning
                per_tensor[i] = np.max(np.abs(fx - fy))
    return float(np.max(per_tensor))
