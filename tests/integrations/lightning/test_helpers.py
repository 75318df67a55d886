"""tests/integrations/lightning/helpers.py: comparing state dicts must not lose a NaN."""

from __future__ import annotations

import math

import torch

from .helpers import max_abs_diff


def test_max_abs_diff_reports_a_nan_outside_the_first_entry() -> None:
    a = {"0.weight": torch.zeros(2, 2), "0.bias": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(3)}
    b = {k: v.clone() for k, v in a.items()}
    b["0.weight"][0, 0] = 0.25
    assert max_abs_diff(a, b) == 0.25
    b["0.bias"][1] = float("nan")
    # the old helper (builtin max over per-entry floats) returned 0.25 here: `<= 1e-5` bounds could pass
    assert math.isnan(max_abs_diff(a, b))
    assert not max_abs_diff(a, b) > 1e-3  # a "did it train" bound fails too
