"""``rescale_lr``: a batch-size change rescales each optimizer's rate and its schedulers' base rates, also
through the PS's optimizer wrapper (the strategy hands Lightning ``PSOptimizer``s; schedulers hold what they wrap)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ivyplug.integrations.lightning.lr_rescale import rescale_lr

from ivyplug.ps import PSClient, PSConfig, PSOptimizer


@pytest.mark.parametrize("wrapped", [False, True])
def test_rates_and_scheduler_base_rates_follow_the_rule(wrapped: bool) -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([w], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)
    client = PSClient.start(PSConfig(mode="sync"), [("w", w)], optimizer=sgd) if wrapped else None
    try:
        opt = PSOptimizer(sgd, client) if client is not None else sgd
        factor = rescale_lr([opt], [SimpleNamespace(scheduler=scheduler)], ["linear"], 32, 64)
    finally:
        if client is not None:
            client.close()
    assert factor == 2.0
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.2)
    assert sgd.param_groups[0]["initial_lr"] == pytest.approx(0.2)
    assert scheduler.base_lrs == [pytest.approx(0.2)]  # the next scheduler step goes on from the new rate
