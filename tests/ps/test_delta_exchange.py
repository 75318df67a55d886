"""The outer optimizers of the delta exchange against float64 references, through a one-worker in-process PS.

Each merge pushes a fresh random delta (and a zero one, and one holding a NaN that the PS drops); after every
merge the worker's copy, pulled from the servers, must equal the reference applied to the same pseudo-gradients.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ivyplug.localsgd.delta_exchange import DeltaExchange, OuterRule
from ivyplug.optim import DelayedNesterov, LocalUpdates
from ivyplug.optim.optimizer import LAMB
from ivyplug.ps import PSClient, PSConfig
from tests.ps.outer_reference import RefAverage, RefDelayedNesterov, ref_lamb

MANUAL = 10**6  # sync_every: the tests call exchange() themselves


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no OpenMP spin-waits


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _start(mode: str, outer: str, **kw: Any) -> tuple[nn.Module, LocalUpdates, PSClient]:
    model = _model(0)
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=MANUAL, outer=outer, **kw)
    client = opt.start_ps(PSConfig(mode=mode), list(model.named_parameters()))
    return model, opt, client


def _values(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().double().numpy().copy() for p in model.parameters()]


def _push(model: nn.Module, opt: LocalUpdates, deltas: list[torch.Tensor]) -> list[np.ndarray]:
    """Move the local copy by ``deltas`` and exchange; returns the pseudo-gradient x_pulled − x_local (float64)."""
    with torch.no_grad():
        for p, d in zip(model.parameters(), deltas, strict=True):
            p.add_(d)
    pseudo = [
        s.double().numpy() - p.detach().double().numpy()
        for s, p in zip(opt.delta.snapshot, model.parameters(), strict=True)
    ]
    opt.exchange()
    return pseudo


def _deltas(model: nn.Module, kind: str, gen: torch.Generator, scale: float = 0.05) -> list[torch.Tensor]:
    out = [torch.randn(p.shape, generator=gen) * scale for p in model.parameters()]
    if kind == "zero":
        return [torch.zeros_like(d) for d in out]
    if kind == "nan":
        out[1].view(-1)[2] = math.nan
    return out


#: zero first (no moments yet), a NaN delta in the middle, a zero delta with live momentum
ROUNDS = ["zero", "rand", "rand", "nan", "rand", "zero", "rand", "rand"]

RULES: dict[str, tuple[dict[str, Any], Any]] = {
    "average": ({}, lambda x: RefAverage(x, rate=1.0)),
    "average-0.3": ({"merge_rate": 0.3}, lambda x: RefAverage(x, rate=0.3)),
    "nesterov": ({}, lambda x: RefDelayedNesterov(x, lr=0.7, beta=0.5, every=1)),
    "nesterov-delayed-3": (
        {"outer_lr": 0.5, "outer_momentum": 0.8, "outer_momentum_every": 3},
        lambda x: RefDelayedNesterov(x, lr=0.5, beta=0.8, every=3),
    ),
    "lamb": ({}, lambda x: ref_lamb(x, lr=0.04, beta1=0.9, max_trust_ratio=10.0)),
    "lamb-clipped": (
        {"outer_lr": 0.2, "outer_momentum": 0.5, "max_trust_ratio": 0.05},
        lambda x: ref_lamb(x, lr=0.2, beta1=0.5, max_trust_ratio=0.05),
    ),
}


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("name", list(RULES))
def test_each_merge_matches_the_float64_reference(name: str, mode: str) -> None:
    kw, make_ref = RULES[name]
    outer = name.split("-")[0]
    model, opt, client = _start(mode, outer, **kw)
    try:
        ref = make_ref(_values(model))
        gen = torch.Generator().manual_seed(sum(map(ord, name + mode)))  # fresh inputs per case
        for i, kind in enumerate(ROUNDS):
            ref.merge(_push(model, opt, _deltas(model, kind, gen)))
            for p, want in zip(model.parameters(), ref.params, strict=True):
                torch.testing.assert_close(
                    p.detach().double(),
                    torch.from_numpy(want),
                    rtol=1e-6,
                    atol=1e-7,
                    msg=lambda m, i=i, k=kind: f"merge {i} ({k}): {m}",
                )
        assert opt.exchanges == len(ROUNDS) and opt.discarded_exchanges == 1
        assert client.metrics()["nonfinite_skipped"] == 1
    finally:
        client.close()


def test_the_servers_build_the_class_the_rule_picks() -> None:
    params = [torch.zeros(3)]
    sgd = OuterRule().build(params, "async", 4)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["lr"] == 0.25 and sgd.defaults["momentum"] == 0
    assert OuterRule(merge_rate=0.3).build(params, "sync", 4).defaults["lr"] == 0.3
    nest = OuterRule("nesterov").build(params, "sync", 4)
    assert type(nest) is torch.optim.SGD
    assert (nest.defaults["lr"], nest.defaults["momentum"], nest.defaults["nesterov"]) == (0.7, 0.5, True)
    delayed = OuterRule("nesterov").build(params, "async", 4)  # one worker's delta per merge: N = 4
    assert type(delayed) is DelayedNesterov and delayed.defaults == {"lr": 0.7, "momentum": 0.5, "momentum_every": 4}
    assert type(OuterRule("nesterov", outer_momentum_every=1).build(params, "ssp", 4)) is torch.optim.SGD
    assert type(OuterRule("nesterov", outer_momentum=0.0).build(params, "sync", 1)) is torch.optim.SGD
    lamb = OuterRule("lamb", max_trust_ratio=3.0).build(params, "async", 2)
    assert type(lamb) is LAMB
    assert lamb.defaults["lr"] == 0.02 and lamb.defaults["max_trust_ratio"] == 3.0
    assert lamb.defaults["weight_decay"] == 0.0 and lamb.defaults["min_trust_ratio"] == 0.0
    assert lamb.defaults["betas"] == (0.9, 0.999)
    assert OuterRule("lamb", outer_lr=0.1).build(params, "async", 2).defaults["lr"] == 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"outer": "adam"}, "outer must be 'average', 'nesterov' or 'lamb', got 'adam'"),
        ({"outer": "nesterov", "outer_lr": 0.0}, "outer_lr must be None or a finite number > 0"),
        ({"outer": "lamb", "outer_lr": math.inf}, "outer_lr must be None or a finite number > 0"),
        ({"outer": "nesterov", "outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\)"),
        ({"outer": "nesterov", "outer_momentum": True}, r"outer_momentum must be a number in \[0, 1\)"),
        ({"outer": "nesterov", "outer_momentum_every": 0}, "outer_momentum_every must be None or an int >= 1"),
        ({"outer": "nesterov", "outer_momentum_every": 2.0}, "outer_momentum_every must be None or an int >= 1"),
        ({"outer": "lamb", "max_trust_ratio": 0.0}, "max_trust_ratio must be a number > 0"),
        ({"outer": "nesterov", "merge_rate": 0.5}, "merge_rate applies to outer='average' only"),
        ({"outer": "average", "outer_lr": 0.5}, "outer_lr applies to outer='nesterov' or 'lamb'"),
        ({"outer": "lamb", "outer_momentum_every": 2}, "outer_momentum_every applies to outer='nesterov' only"),
        ({"merge_rate": -1.0}, "merge_rate must be None or a finite number > 0"),
    ],
)
def test_bad_rules_are_refused_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OuterRule(**kwargs)
    with pytest.raises(ValueError, match=match):  # the wrapper checks at construction, before any PS starts
        LocalUpdates(torch.optim.SGD(_model(0).parameters(), lr=0.1), **kwargs)


def test_build_checks_mode_and_workers_and_the_exchange_its_rule() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        OuterRule("lamb").build([torch.zeros(2)], "bsp", 2)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        OuterRule("nesterov").build([torch.zeros(2)], "async", 0)
    with pytest.raises(ValueError, match="differs from the rule's"):
        DeltaExchange([torch.zeros(2)], merge_rate=0.5, rule=OuterRule(merge_rate=0.25))
    ex = DeltaExchange([torch.zeros(2)], merge_rate=0.5)
    assert ex.merge_rate == 0.5 and type(ex.outer_optimizer("sync", 1)) is torch.optim.SGD
    assert type(ex.outer_optimizer("sync", 1, OuterRule("lamb"))) is LAMB and ex.rule.outer == "lamb"


def _layer_steps(before: list[np.ndarray], after: list[np.ndarray]) -> list[float]:
    return [float(np.linalg.norm(b - a)) for a, b in zip(before, after, strict=True)]


@pytest.mark.parametrize("max_trust_ratio", [1.0, 10.0])
def test_lamb_bounds_how_far_an_adversarial_delta_moves_a_layer(max_trust_ratio: float) -> None:
    """‖Δx_layer‖ ≤ max_trust_ratio · outer_lr · ‖x_layer‖ (LAMB: ≤ outer_lr · ‖x_layer‖); average: no bound."""
    lr = 0.05
    moved: dict[str, list[float]] = {}
    for outer, kw in (("lamb", {"outer_lr": lr, "max_trust_ratio": max_trust_ratio}), ("average", {})):
        model, opt, client = _start("async", outer, **kw)
        try:
            gen = torch.Generator().manual_seed(7)
            ratios = []
            for sign in (1.0, -1.0, 1.0):
                before = _values(model)
                huge = [sign * 1e4 * torch.randn(p.shape, generator=gen) for p in model.parameters()]
                _push(model, opt, huge)
                steps = _layer_steps(before, _values(model))
                bounds = [lr * float(np.linalg.norm(x)) for x in before]
                assert all(b > 0 for b in bounds)  # every layer of this model has a nonzero norm
                ratios += [s / b for s, b in zip(steps, bounds, strict=True)]
            moved[outer] = ratios
        finally:
            client.close()
    # float32 masters: allow a relative 1e-5 over the exact bound
    assert max(moved["lamb"]) <= 1.0 + 1e-5  # ‖Δx‖ ≤ outer_lr · ‖x‖ ≤ max_trust_ratio · outer_lr · ‖x‖
    assert max(moved["lamb"]) <= max_trust_ratio * (1.0 + 1e-5)
    assert max(moved["lamb"]) > 0.5  # the clip is what stops it, not a tiny step
    first = moved["average"][: len(list(_model(0).parameters()))]  # from the same start as LAMB's first merge
    assert min(first) > 1e3 * max_trust_ratio  # without the trust-ratio clip: far past the bound


@pytest.mark.parametrize(("outer", "kw"), [("nesterov", {"outer_momentum_every": 3}), ("lamb", {})])
def test_the_outer_state_is_in_the_ps_checkpoint_and_resumes_bitwise(outer: str, kw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(11)
    model, opt, client = _start("async", outer, **kw)
    try:
        for _ in range(4):  # mid-cycle for N = 3: the servers hold an accumulator and a momentum buffer
            _push(model, opt, _deltas(model, "rand", gen))
        buf = io.BytesIO()
        torch.save(client.state_dict(), buf)
        later = [_deltas(model, "rand", gen) for _ in range(4)]
        for d in later:
            _push(model, opt, d)
        want = _values(model)
    finally:
        client.close()
    model2, opt2, client2 = _start("async", outer, **kw)
    try:
        client2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))  # ends with a pull
        opt2.reset_snapshot()
        for d in later:
            _push(model2, opt2, d)
        assert all(np.array_equal(a, b) for a, b in zip(_values(model2), want, strict=True))
    finally:
        client2.close()


@pytest.mark.parametrize("name", ["nesterov", "nesterov-delayed-3", "lamb"])
def test_h1_training_merges_every_step_like_the_reference(name: str) -> None:
    """sync_every=1: each local SGD step is one merge; the pushed pseudo-gradients replayed in float64 agree."""
    kw, make_ref = RULES[name]
    model = _model(1)
    opt = LocalUpdates(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, outer=name.split("-")[0], **kw)
    client = opt.start_ps(PSConfig(mode="sync"), list(model.named_parameters()))
    ref = make_ref(_values(model))
    pushed: list[list[np.ndarray]] = []
    exchange = opt.delta.exchange

    def recording(local_steps: int) -> None:
        pushed.append(
            [
                s.double().numpy() - p.detach().double().numpy()
                for s, p in zip(opt.delta.snapshot, model.parameters(), strict=True)
            ]
        )
        exchange(local_steps)

    opt.delta.exchange = recording  # type: ignore[method-assign]
    try:
        gen = torch.Generator().manual_seed(5)
        for _ in range(5):
            x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert len(pushed) == opt.exchanges == 5
        for g in pushed:
            ref.merge(g)
        for p, want in zip(model.parameters(), ref.params, strict=True):
            torch.testing.assert_close(p.detach().double(), torch.from_numpy(want), rtol=1e-6, atol=1e-7)
    finally:
        client.close()
