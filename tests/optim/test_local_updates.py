"""``LocalUpdates`` around any torch optimizer, and ``AsyncLAMB`` as LAMB in it: one worker, in-process PS."""

from __future__ import annotations

import copy
import doctest
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ivyplug.localsgd import local_updates
from ivyplug.localsgd.optimizer_protocol import DeltaExchangingOptimizer
from ivyplug.optim import LAMB, AsyncLAMB, LocalUpdates
from ivyplug.ps import PSConfig

Make = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]

INNER: dict[str, Make] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
    "lamb": lambda ps: LAMB(ps, lr=0.02),
}


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("name", [*INNER, "AsyncLAMB"])
def test_h1_one_worker_average_at_rate_1_is_plain_training(name: str, mode: str) -> None:
    """sync_every=1, one worker, outer="average", merge_rate=1: every step goes through the PS, nothing changes.

    The servers apply x ← x − 1 · fl(x − x_local) in float32. That is x_local exactly wherever the subtraction
    is exact (Sterbenz: x_local within a factor 2 of x), which is nearly every element; where a step crosses
    zero, fl(x − x_local) rounds and the element lands within an ulp of the step. So: bitwise equal but for
    those, and those within float32 rounding.
    """
    model, ref = _mlp(0), _mlp(0)
    if name == "AsyncLAMB":
        opt: LocalUpdates = AsyncLAMB(model.parameters(), lr=0.02, sync_every=1, merge_rate=1.0)
        ref_opt = INNER["lamb"](ref.parameters())
    else:
        opt = LocalUpdates(INNER[name](model.parameters()), sync_every=1, outer="average", merge_rate=1.0)
        ref_opt = INNER[name](ref.parameters())
    client = opt.start_ps(PSConfig(mode=mode), list(model.named_parameters()))
    try:
        _train(model, opt, 6)
        _train(ref, ref_opt, 6)
        assert opt.exchanges == 6 and client.metrics()["pushes"] == 6
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        want = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
        assert (got == want).double().mean() >= 0.95
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    finally:
        client.close()


@pytest.mark.parametrize("name", list(INNER))
def test_without_a_ps_it_is_the_inner_optimizer_bitwise(name: str) -> None:
    a, b = _mlp(0), _mlp(0)
    opt = LocalUpdates(INNER[name](a.parameters()), sync_every=2, outer="lamb")
    _train(a, opt, 5)
    _train(b, INNER[name](b.parameters()), 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not opt.attached and opt.exchanges == 0


def test_it_is_what_the_lightning_strategy_runs() -> None:
    opt = LocalUpdates(torch.optim.SGD(_mlp(0).parameters(), lr=0.1))
    assert isinstance(opt, DeltaExchangingOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert isinstance(AsyncLAMB(_mlp(0).parameters()), DeltaExchangingOptimizer)
    assert opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state


def test_wrapping_needs_a_plain_torch_optimizer() -> None:
    with pytest.raises(ValueError, match=r"inner must be a torch\.optim\.Optimizer"):
        LocalUpdates(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already a LocalUpdates"):
        LocalUpdates(AsyncLAMB(_mlp(0).parameters()))
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        LocalUpdates(torch.optim.SGD(_mlp(0).parameters(), lr=0.1), sync_every=0)


def test_hooks_run_once_per_step_and_a_scheduler_drives_the_inner_lr() -> None:
    model = _mlp(0)
    opt = LocalUpdates(torch.optim.AdamW(model.parameters(), lr=0.01), sync_every=2, outer="nesterov")
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    calls: dict[str, int] = {"wrapper": 0, "inner": 0}

    def count(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if o is opt:
            calls["wrapper"] += 1
        elif o is opt.inner:
            calls["inner"] += 1

    handles = [
        opt.register_step_post_hook(count),
        register_optimizer_step_pre_hook(count),
    ]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                _train(model, opt, 1, seed=i)
                sched.step()
        assert not [w for w in caught if "lr_scheduler" in str(w.message)]
        assert calls == {"wrapper": 8, "inner": 0}  # one post hook + one global pre hook per step
        assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)
        assert opt.exchanges == 2
    finally:
        for h in handles:
            h.remove()
        client.close()


@pytest.mark.parametrize("wrapper", ["LocalUpdates", "AsyncLAMB"])
def test_the_inner_optimizers_own_step_hooks_run_once_per_step_around_its_step(wrapper: str) -> None:
    """Hooks registered on the inner optimizer run as its ``step()`` would run them (torch's
    ``PostLocalSGDOptimizer`` calls ``inner.step()``); they were skipped. Global hooks still run once, with the
    wrapper's. A pre hook may replace the arguments, as torch lets it."""
    model = _mlp(0)
    opt: LocalUpdates = (
        LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1))
        if wrapper == "LocalUpdates"
        else AsyncLAMB(model.parameters())
    )
    calls: list[str] = []
    losses: list[float] = []

    def replace_closure(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any]:
        calls.append("inner-pre")
        return (), {"closure": lambda: losses.append(1.0) or 1.0}

    handles = [
        opt.inner.register_step_pre_hook(replace_closure),
        opt.inner.register_step_post_hook(lambda o, a, k: calls.append("inner-post")),
        opt.register_step_pre_hook(lambda o, a, k: calls.append("wrapper-pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("wrapper-post")),
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(f"global-pre-{type(o).__name__}")),
    ]
    try:
        _train(model, opt, 2, seed=0)
    finally:
        for h in handles:
            h.remove()
    assert calls == [f"global-pre-{wrapper}", "wrapper-pre", "inner-pre", "inner-post", "wrapper-post"] * 2, calls
    assert losses == [1.0, 1.0]  # the closure the pre hook gave was the one the inner step ran


def test_checkpoints_keep_the_ps_and_copies_are_detached() -> None:
    model = _mlp(0)
    opt = LocalUpdates(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), sync_every=3, outer="nesterov", outer_lr=0.5
    )
    client = opt.start_ps(PSConfig(mode="sync"), list(model.named_parameters()))
    try:
        _train(model, opt, 4)
        sd = opt.state_dict()
        assert sd["local_updates"]["outer"] == "nesterov" and sd["local_updates"]["exchanges"] == 1
        assert sd["state"].keys() == opt.inner.state_dict()["state"].keys()
        opt.load_state_dict(copy.deepcopy(sd))
        assert opt.attached and opt.exchanges == 1 and opt.local_steps == 1
        dup = copy.deepcopy(opt)
        assert not dup.attached and dup.rule == opt.rule and dup.exchanges == 1 and dup.sync_every == 3
        assert dup.inner is not opt.inner and dup.param_groups[0]["momentum"] == 0.9
        _train(model, opt, 2)
        assert opt.exchanges == 2 and client.metrics()["pushes"] == 2
        with pytest.raises(RuntimeError, match="after the PS started"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    finally:
        client.close()


def test_async_lamb_takes_the_outer_options() -> None:
    opt = AsyncLAMB(_mlp(0).parameters(), max_trust_ratio=4.0, outer="lamb", outer_lr=0.02, outer_momentum=0.8)
    lamb = opt.outer_optimizer("sync", 2)
    assert type(lamb) is LAMB
    assert (lamb.defaults["lr"], lamb.defaults["betas"], lamb.defaults["max_trust_ratio"]) == (0.02, (0.8, 0.999), 4.0)
    nest = AsyncLAMB(_mlp(0).parameters(), outer="nesterov", outer_momentum_every=2).outer_optimizer("async", 2)
    assert type(nest).__name__ == "DelayedNesterov" and nest.defaults["momentum_every"] == 2
    extra = opt.state_dict()["async_lamb"]
    assert (extra["outer"], extra["outer_lr"], extra["outer_momentum"], extra["outer_momentum_every"]) == (
        "lamb",
        0.02,
        0.8,
        None,
    )
    assert isinstance(opt.inner, LAMB) and opt.skipped_steps == 0 and opt.max_grad_norm is None
    with pytest.raises(ValueError, match="outer must be"):
        AsyncLAMB(_mlp(0).parameters(), outer="sgd")
    with pytest.raises(ValueError, match="merge_rate applies to outer='average' only"):
        AsyncLAMB(_mlp(0).parameters(), outer="lamb", merge_rate=0.5)


def test_docstring_example_runs() -> None:
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(local_updates.LocalUpdates, "LocalUpdates", globs={}) if t.examples]
    assert tests
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
