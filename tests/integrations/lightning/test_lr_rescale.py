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


@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
def test_cycling_schedulers_go_on_from_the_rescaled_rates(kind: str) -> None:
    """OneCycleLR keeps its peak and floor in the param groups (``max_lr``, ``min_lr``) and CyclicLR its peaks on
    itself (``max_lrs``): rescaled with the rate, the schedule goes on at the new scale; before, its next step went
    back to the old one (0.0246 after x0.5, then 0.0486)."""
    rates = []
    for factor in (1.0, 0.5):
        w = torch.nn.Parameter(torch.zeros(3))
        sgd = torch.optim.SGD([w], lr=0.01, momentum=0.9)
        scheduler: torch.optim.lr_scheduler.LRScheduler
        if kind == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.05, total_steps=20)
        else:
            scheduler = torch.optim.lr_scheduler.CyclicLR(sgd, base_lr=0.01, max_lr=0.05, step_size_up=4)
        for _ in range(3):
            sgd.step()
            scheduler.step()
        rescale_lr([sgd], [SimpleNamespace(scheduler=scheduler)], ["linear"], 64, round(64 * factor))
        seen = []
        for _ in range(6):
            sgd.step()
            scheduler.step()
            seen.append(sgd.param_groups[0]["lr"])
        rates.append(seen)
    torch.testing.assert_close(torch.tensor(rates[1]), 0.5 * torch.tensor(rates[0]), rtol=1e-6, atol=0.0)
