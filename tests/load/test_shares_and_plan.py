"""Worker shares (LB-BSP) against a float64 reference, and epoch plans that use every sample once."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ivyplug.load import gradient_weights, measured_speeds, plan_epoch, smooth_speeds, step_sizes, worker_shares


def test_shares_match_the_proportional_reference_on_random_inputs() -> None:
    rng = np.random.default_rng(11)
    for _ in range(500):
        workers = int(rng.integers(1, 9))
        batch = int(rng.integers(workers, 2000))
        speeds = rng.uniform(0.05, 50.0, size=workers)
        shares = worker_shares(batch, speeds.tolist())
        ideal = batch * speeds.astype(np.float64) / speeds.sum()
        assert sum(shares) == batch and min(shares) >= 1
        # largest-remainder rounding stays within one sample of the ideal unless the floor of 1 lifted it
        lifted = ideal < 1
        assert np.all(np.abs(np.array(shares) - ideal)[~lifted] < 1.0 + lifted.sum())


def test_share_edge_cases() -> None:
    assert worker_shares(10, [1.0]) == [10]
    assert worker_shares(4, [1.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 1]
    assert worker_shares(3, [1000.0, 1.0, 1.0]) == [1, 1, 1]
    assert worker_shares(10, [1000.0, 1.0]) == [9, 1]
    assert worker_shares(64, [3.0, 1.0]) == [48, 16]
    with pytest.raises(ValueError, match="at least the number of workers"):
        worker_shares(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"speeds\[1\]"):
        worker_shares(8, [1.0, 0.0])
    with pytest.raises(ValueError, match="empty"):
        worker_shares(8, [])
    assert gradient_weights([48, 16]) == [0.75, 0.25]
    assert measured_speeds([10, 20], [2.0, 0.0], floor=0.5) == [5.0, 40.0]
    assert smooth_speeds([1.0, 3.0], [3.0, 1.0], keep=0.5) == [2.0, 2.0]
    assert smooth_speeds(None, [3.0], keep=0.5) == [3.0]


@pytest.mark.parametrize("drop_last", [False, True])
def test_plan_uses_every_sample_once_with_equal_step_counts(drop_last: bool) -> None:
    rng = random.Random(3)
    for _ in range(200):
        workers = rng.randint(1, 4)
        n = rng.randint(4 * workers, 600)
        batch = rng.randint(2 * workers, max(2 * workers, n // 2))
        shares = worker_shares(batch, [rng.uniform(0.2, 3.0) for _ in range(workers)])
        order = list(range(n))
        rng.shuffle(order)
        plan = plan_epoch(order, batch, shares, drop_last=drop_last)
        steps = {len(plan.for_worker(w)) for w in range(workers)}
        assert steps == {plan.steps}
        used = [i for w in range(workers) for b in plan.for_worker(w) for i in b]
        if drop_last:
            assert len(used) == (n // batch) * batch and len(set(used)) == len(used)
        else:
            assert sorted(used) == list(range(n))
        for s in range(plan.steps):
            assert all(len(plan.for_worker(w)[s]) >= 1 for w in range(workers))
            assert sum(plan.weight(w, s) for w in range(workers)) == pytest.approx(1.0)
        full = [s for s in range(plan.steps) if plan.step_sizes[s] == batch]
        for s in full:
            assert [len(plan.for_worker(w)[s]) for w in range(workers)] == shares


def test_step_sizes_and_plan_errors() -> None:
    assert step_sizes(10, 4) == [4, 3, 3]
    assert step_sizes(10, 4, drop_last=True) == [4, 4]
    assert step_sizes(0, 4) == []
    with pytest.raises(ValueError, match="sum to batch_size"):
        plan_epoch(list(range(10)), 4, [1, 1])
    with pytest.raises(ValueError, match="non-empty batch"):
        plan_epoch(list(range(4)), 3, [1, 1, 1])  # two steps of 2 samples cannot feed 3 workers
