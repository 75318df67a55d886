"""Batch-size policy: grow, shrink, hysteresis, cooldown, bounds, OOM ceiling; observations."""

from __future__ import annotations

import pytest

from ivyplug.load import (
    BatchSizePolicy,
    LoadObservation,
    PolicyState,
    combine_observations,
    observation_from_readings,
    observation_from_summary,
)
from ivyplug.load.sampler import Stat

IDLE = LoadObservation(utilization=20.0, memory_fraction=0.3)
BUSY = LoadObservation(utilization=95.0, memory_fraction=0.3)
FULL = LoadObservation(utilization=50.0, memory_fraction=0.95)
BAND = LoadObservation(utilization=10.0, memory_fraction=0.75)


def run(policy: BatchSizePolicy, b: int, observations: list[LoadObservation]) -> list[int]:
    state = None
    out = []
    for obs in observations:
        d = policy.decide(b, obs, state)
        b, state = d.batch_size, d.state
        out.append(b)
    return out


def test_idle_grows_with_cooldown_up_to_the_bound() -> None:
    policy = BatchSizePolicy(min_batch_size=8, max_batch_size=100, cooldown=1, goodput=False)
    assert run(policy, 16, [IDLE] * 6) == [32, 32, 64, 64, 100, 100]
    assert run(BatchSizePolicy(8, 100, cooldown=0, goodput=False), 16, [IDLE] * 3) == [32, 64, 100]


def test_memory_pressure_shrinks_at_once_and_busy_or_band_holds() -> None:
    policy = BatchSizePolicy(min_batch_size=8, max_batch_size=128, cooldown=3, goodput=False)
    assert run(policy, 64, [FULL, FULL, FULL, FULL]) == [32, 16, 8, 8]
    assert run(policy, 64, [BUSY] * 5) == [64] * 5
    assert run(policy, 64, [BAND] * 5) == [64] * 5  # hysteresis band: neither grow nor shrink
    d = policy.decide(64, LoadObservation(utilization=10.0))
    assert not d.changed and "unknown" in d.reason


def test_oom_shrinks_and_caps_later_growth() -> None:
    policy = BatchSizePolicy(min_batch_size=4, max_batch_size=256, cooldown=0, goodput=False)
    d = policy.decide(64, LoadObservation(utilization=10.0, memory_fraction=0.2, oom_count=1))
    assert d.batch_size == 32 and d.changed and d.state.ceiling == 32 and "out of memory" in d.reason
    assert run(policy, 32, [IDLE] * 3) == [64, 128, 256]  # without state: no ceiling
    state = d.state
    for _ in range(3):
        d = policy.decide(d.batch_size, IDLE, state)
        state = d.state
        assert d.batch_size == 32 and not d.changed


def test_small_changes_are_not_worth_it() -> None:
    policy = BatchSizePolicy(min_batch_size=1, max_batch_size=102, cooldown=0, min_relative_change=0.05, goodput=False)
    d = policy.decide(100, IDLE)
    assert d.batch_size == 100 and not d.changed and "below 5%" in d.reason
    assert policy.decide(100, IDLE).state.since_change > 0


def test_state_round_trips() -> None:
    s = PolicyState(since_change=2, ceiling=48)
    assert PolicyState.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_batch_size": 0, "max_batch_size": 8}, "min_batch_size"),
        ({"min_batch_size": 16, "max_batch_size": 8}, "max_batch_size"),
        ({"min_batch_size": 1, "max_batch_size": 8, "grow_factor": 1.0}, "grow_factor"),
        ({"min_batch_size": 1, "max_batch_size": 8, "shrink_factor": 1.0}, "shrink_factor"),
        ({"min_batch_size": 1, "max_batch_size": 8, "memory_low": 0.9, "memory_high": 0.8}, "hysteresis"),
        ({"min_batch_size": 1, "max_batch_size": 8, "cooldown": -1}, "cooldown"),
        ({"min_batch_size": 1, "max_batch_size": 8, "grow_below_utilization": 101}, "grow_below_utilization"),
    ],
)
def test_bad_configuration_names_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchSizePolicy(**kwargs)


def test_observations_prefer_the_gpu_and_fall_back_to_host() -> None:
    readings = {"gpu1_util": 40.0, "gpu1_mem_used": 30.0, "gpu1_mem_total": 40.0, "cpu_util": 90.0}
    readings.update({"mem_used": 1.0, "mem_total": 4.0})
    assert observation_from_readings(readings, device_index=1) == LoadObservation(40.0, 0.75)
    assert observation_from_readings(readings, device_index=None) == LoadObservation(90.0, 0.25)
    alloc = {"cuda0_peak": 6.0, "cuda0_total": 8.0, "cpu_util": 10.0}
    assert observation_from_readings(alloc, device_index=0, oom_count=2) == LoadObservation(10.0, 0.75, 2)
    stats = {"cpu_util": Stat(30.0, 80.0, 0.0, 5.0, 4), "mem_used": Stat(1.0, 3.0, 0.5, 1.0, 4)}
    stats["mem_total"] = Stat(4.0, 4.0, 4.0, 4.0, 4)
    assert observation_from_summary(stats) == LoadObservation(30.0, 0.75)  # mean util, peak memory
    merged = combine_observations([LoadObservation(20.0, 0.5, 1), LoadObservation(60.0, 0.9), LoadObservation()])
    assert merged == LoadObservation(40.0, 0.9, 1)
    with pytest.raises(ValueError, match="utilization"):
        LoadObservation(utilization=150.0)


def test_a_batch_size_outside_the_bounds_moves_only_toward_them() -> None:
    """B below ``min_batch_size`` under memory pressure was "shrunk" up to the minimum (and the learning rate with
    it); B above ``max_batch_size`` on an idle device was "grown" down to the maximum. A shrink never grows B and a
    growth never shrinks it: outside the bounds B holds until a decision moves it toward them."""
    policy = BatchSizePolicy(min_batch_size=24, max_batch_size=48, cooldown=0, goodput=False)
    below = policy.decide(16, FULL)
    assert (below.batch_size, below.changed) == (16, False) and "at the bound" in below.reason
    assert policy.decide(16, IDLE).batch_size == 32  # a growth from below moves it in
    above = policy.decide(64, IDLE)
    assert (above.batch_size, above.changed) == (64, False) and "at the bound" in above.reason
    assert policy.decide(64, FULL).batch_size == 32  # a shrink from above moves it in
    assert policy.decide(100, FULL).batch_size == 48  # ... as far as the bound
