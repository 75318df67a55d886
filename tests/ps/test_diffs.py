"""tests/ps/diffs.py: the tensor comparison the PS, Lightning and Keras tests share must not lose a NaN."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from tests.ps.diffs import max_abs_diff


def _old_max_of_floats(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """What the tests did before: the builtin ``max`` over per-tensor floats, written out (same comparisons).

    It keeps the running value when a later one is NaN, because ``nan > m`` is false.
    """
    diffs = [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]
    return functools.reduce(lambda m, d: d if d > m else m, diffs)


def test_nan_in_a_tensor_other_than_the_first_is_reported() -> None:
    a = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(4)]
    b = [torch.full((3,), 0.5), torch.zeros(2, 2), torch.zeros(4)]
    b[1][1, 0] = float("nan")
    assert _old_max_of_floats(a, b) == 0.5  # the NaN went unnoticed: `<= 1e-5`-style bounds could pass
    got = max_abs_diff(a, b)
    assert math.isnan(got)
    assert not got <= 1e-5 and not got > 1e-4  # fails an "equal" bound and a "differs" bound alike


@pytest.mark.parametrize("where", [0, 1, 2])
def test_nan_or_inf_anywhere_is_nan_and_numpy_inputs_too(where: int) -> None:
    a = [np.zeros(2, np.float32), np.ones((2, 3)), np.zeros(())]
    b = [x.copy() for x in a]
    b[where][...] = np.nan
    assert math.isnan(max_abs_diff(a, b))
    b = [x.copy() for x in a]
    a[where][...], b[where][...] = np.inf, np.inf  # inf - inf is NaN: not "equal"
    assert math.isnan(max_abs_diff(a, b))


def test_value_dtypes_and_misuse() -> None:
    a = [torch.tensor([1.0, 2.0]), torch.tensor([3], dtype=torch.int64), torch.tensor([1.0], dtype=torch.bfloat16)]
    b = [torch.tensor([1.0, 2.25]), torch.tensor([1], dtype=torch.int64), torch.tensor([1.0], dtype=torch.bfloat16)]
    assert max_abs_diff(a, b) == 2.0
    assert max_abs_diff([torch.zeros(0)], [torch.zeros(0)]) == 0.0
    assert max_abs_diff([[1.0, 2.0]], [np.array([1.0, 1.5])]) == 0.5  # JSON lists of floats
    with pytest.raises(ValueError, match="shape"):
        max_abs_diff([torch.zeros(3)], [torch.zeros(1)])  # no broadcasting
    with pytest.raises(ValueError, match="1 tensors against 2"):
        max_abs_diff([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match="no tensors"):
        max_abs_diff([], [])
