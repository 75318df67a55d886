"""``sync_every="auto"``: the period against a float64 reference, the controller on a scripted clock (a 3x
slower worker takes a third of the steps), and LocalUpdates choosing it from real measured times."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from ivyplug.localsgd.sync_period import (
    COMM_SHARE,
    FIRST_EXCHANGES,
    MAX_H,
    MIN_H,
    START_H,
    SyncPeriod,
    check_sync_period,
    period_for,
)
from ivyplug.optim import AsyncLAMB, LocalUpdates
from ivyplug.ps import PSConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: no OpenMP spin-waits in the timed steps


def ref_period(step: float, exchange: float, share: float = COMM_SHARE) -> int:
    """The smallest integer H >= 1 with exchange / (H * step + exchange) <= share, by search, in float64."""
    if step <= 0:
        return MAX_H
    for h in range(MIN_H, MAX_H + 1):
        if exchange <= share * (h * step + exchange) * (1 + 1e-12):
            return h
    return MAX_H


def test_period_against_a_reference_on_random_times() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        step = 10 ** rng.uniform(-5, 0)
        exchange = 10 ** rng.uniform(-5, 1)
        assert period_for(step, exchange) == ref_period(step, exchange), (step, exchange)
    assert period_for(0.01, 0.0) == MIN_H
    assert period_for(0.0, 0.5) == MAX_H
    assert period_for(1e-6, 10.0) == MAX_H
    assert period_for(0.01, 0.01) == 9  # an exchange as long as a step: 9 steps keep it at 10%


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(period: SyncPeriod, clock: Clock, step_s: float, exchange_s: float, steps: int) -> list[int]:
    """Drive ``period`` as LocalUpdates does; returns the number of local steps between consecutive exchanges."""
    held, between = 0, []
    for _ in range(steps):
        clock.now += step_s
        held += 1
        period.step_ended()
        if held >= period.value:
            period.exchange_started()
            clock.now += exchange_s
            period.exchange_ended()
            between.append(held)
            held = 0
    return between


def test_a_slower_worker_takes_proportionally_fewer_steps_per_exchange() -> None:
    runs = {}
    for name, step_s in (("fast", 0.010), ("slow", 0.030)):
        clock = Clock()
        period = SyncPeriod("auto", clock=clock)
        between = _run(period, clock, step_s, 0.050, 400)
        assert between[:FIRST_EXCHANGES] == [START_H] * FIRST_EXCHANGES  # measured before choosing
        runs[name] = (period.value, between)
    assert runs["fast"][0] == ref_period(0.010, 0.050) == 45
    assert runs["slow"][0] == ref_period(0.030, 0.050) == 15
    # exchanges arrive about evenly in time: each worker's period of steps lasts about as long
    fast_time = runs["fast"][0] * 0.010
    slow_time = runs["slow"][0] * 0.030
    assert slow_time == pytest.approx(fast_time, rel=0.05)
    # the control: a fixed sync_every ignores the times
    clock = Clock()
    fixed = SyncPeriod(16, clock=clock)
    assert set(_run(fixed, clock, 0.030, 0.050, 200)) == {16} and fixed.retune() == 16


def test_retune_follows_a_change_of_speed_and_a_pause_is_not_a_step() -> None:
    clock = Clock()
    period = SyncPeriod("auto", clock=clock)
    _run(period, clock, 0.010, 0.050, 300)
    assert period.value == 45
    period.pause()
    clock.now += 30.0  # validation: not a step
    _run(period, clock, 0.040, 0.050, 300)  # the worker slowed down (a busy device)
    assert period.retune() == ref_period(0.040, 0.050) == 12


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "Auto", "16", None])
def test_bad_sync_every_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"sync_every must be an int >= 1 .* or 'auto'"):
        check_sync_period(bad)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sync_every"):
        LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_every"):
        AsyncLAMB(model.parameters(), sync_every=bad)  # type: ignore[arg-type]


def test_local_updates_choose_the_period_from_real_times() -> None:
    """One in-process worker: slow local steps (30 ms) give a short period, fast ones a long one. The choice is
    kept in a state dict and a copy as "auto", and the exchanges happen at the chosen period."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=1e-3), sync_every="auto")
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    try:

        def steps(n: int, sleep_s: float) -> None:
            for _ in range(n):
                model(torch.randn(4, 64)).square().mean().backward()
                time.sleep(sleep_s)
                opt.step()
                opt.zero_grad()

        assert opt.sync_every == START_H
        steps(START_H * FIRST_EXCHANGES + 3, 0.030)
        slow = opt.retune_sync_every()
        opt.flush()
        steps(200, 0.0)
        fast = opt.retune_sync_every()
        assert slow < fast, (slow, fast)
        opt.flush()
        before = opt.exchanges
        steps(fast * 2, 0.0)
        assert opt.exchanges - before == 2
        assert opt.state_dict()[LocalUpdates.state_key]["sync_every"] == "auto"
        assert math.isfinite(float(model.weight.detach().sum()))
    finally:
        client.close()


def test_with_overlap_the_period_counts_the_whole_background_exchange_not_its_wait() -> None:
    """Local steps of ~5 ms and an exchange of >= 60 ms on its background thread (the PS answers late, as over
    a slow link). The wait an overlapped exchange leaves is ~0 once H steps cover it, so a period chosen from
    the wait collapses to a few steps and the exchanges, always in flight, take the cores the steps need; from
    the whole exchange, H covers it ~9 times over (the share rule), here about 100."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=1e-3), sync_every="auto", overlap=True)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    real_step = client.step

    def late_step(*args: object, **kwargs: object) -> None:
        time.sleep(0.060)
        real_step(*args, **kwargs)  # type: ignore[arg-type]

    client.step = late_step  # type: ignore[method-assign]
    try:
        for _ in range(START_H * FIRST_EXCHANGES + 240):
            model(torch.randn(4, 16)).square().mean().backward()
            time.sleep(0.005)
            opt.step()
            opt.zero_grad()
        chosen = opt.retune_sync_every()
        assert opt.exchanges >= FIRST_EXCHANGES + 1
        # 60 ms exchanges over steps of 5 ms (or up to ~20 ms on a loaded machine): H >= ceil(0.06*9/0.02) = 27
        assert chosen >= 25, chosen
        assert chosen >= ref_period(0.020, 0.060) - 2
    finally:
        client.close()
