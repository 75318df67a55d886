"""``DelayedNesterov`` against the float64 reference, torch's Nesterov SGD, checkpoints, and the PS mirror."""

from __future__ import annotations

import copy
import doctest
import math
from typing import Any

import pytest
import torch

from ivyplug.localsgd import outer
from ivyplug.optim import DelayedNesterov
from ivyplug.ps.server.mirror import OptimizerSpec
from tests.ps.outer_reference import RefDelayedNesterov

SHAPES = [(4, 3), (3,), (2, 2, 2)]


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _grads(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("every", [1, 2, 3])
def test_matches_the_float64_reference(every: int) -> None:
    params = _params(every)
    opt = DelayedNesterov(params, lr=0.3, momentum=0.85, momentum_every=every)
    ref = RefDelayedNesterov([p.detach().double().numpy() for p in params], lr=0.3, beta=0.85, every=every)
    gen = torch.Generator().manual_seed(100 + every)
    for k in range(2 * every + 2):
        grads = _grads(gen) if k != 1 else [torch.zeros(s) for s in SHAPES]  # a zero gradient with live momentum
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        ref.merge([g.double().numpy() for g in grads])
        for p, want in zip(params, ref.params, strict=True):
            torch.testing.assert_close(p.detach().double(), torch.from_numpy(want), rtol=1e-6, atol=1e-7)


def test_every_1_is_torch_nesterov_sgd() -> None:
    a, b = _params(0), _params(0)
    mine = DelayedNesterov(a, lr=0.7, momentum=0.9, momentum_every=1)
    theirs = torch.optim.SGD(b, lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = _grads(gen)
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_parameter_without_a_gradient_is_not_stepped_nor_counted() -> None:
    params = _params(1)
    opt = DelayedNesterov(params, lr=0.5, momentum=0.9, momentum_every=2)
    before = params[2].detach().clone()
    for _ in range(3):
        for p in params[:2]:
            p.grad = torch.ones_like(p)
        params[2].grad = None
        opt.step()
    assert torch.equal(params[2].detach(), before) and not opt.state[params[2]]
    assert opt.state[params[0]]["step"] == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.1}, "lr must be a finite number >= 0"),
        ({"lr": math.nan}, "lr must be a finite number >= 0"),
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
        ({"momentum_every": 0}, "momentum_every must be an int >= 1"),
        ({"momentum_every": True}, "momentum_every must be an int >= 1"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DelayedNesterov(_params(0), **kwargs)
    opt = DelayedNesterov(_params(0)[:1])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": _params(1)[1:], **kwargs})
    assert len(opt.param_groups) == 1


def test_a_checkpoint_continues_bitwise() -> None:
    def run(opt: DelayedNesterov, params: list[torch.Tensor], seed: int, steps: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p, g in zip(params, _grads(gen), strict=True):
                p.grad = g
            opt.step()

    params = _params(4)
    opt = DelayedNesterov(params, lr=0.2, momentum=0.9, momentum_every=3)
    run(opt, params, 1, 4)  # mid-cycle: the accumulator holds one gradient
    saved, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    run(opt, params, 2, 5)
    twin = [v.clone().requires_grad_() for v in values]
    resumed = DelayedNesterov(twin, lr=0.2, momentum=0.9, momentum_every=3)
    resumed.load_state_dict(saved)
    run(resumed, twin, 2, 5)
    assert all(torch.equal(p, q) for p, q in zip(params, twin, strict=True))


def test_the_servers_mirror_it() -> None:
    """What ``PSClient.start`` does with the optimizer it is given: the same class, built over server masters."""
    params = _params(5)
    worker = DelayedNesterov(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], momentum=0.8, momentum_every=2
    )
    spec = OptimizerSpec.from_optimizer(worker, params)
    assert spec.cls is DelayedNesterov
    assert spec.ctor_kwargs == {"lr": 0.7, "momentum": 0.8, "momentum_every": 2}
    masters = [p.detach().clone() for p in params]
    server, groups = spec.build({0: masters[:2], 1: masters[2:]})
    assert type(server) is DelayedNesterov
    worker.param_groups[0]["lr"] = 0.25  # a scheduler's change travels with the next push
    spec.decode_into(spec.encode(worker), groups)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        grads = _grads(gen)
        for p, m, g in zip(params, masters, grads, strict=True):
            p.grad, m.grad = g.clone(), g.clone()
        worker.step()
        server.step()
    assert [g["lr"] for g in server.param_groups] == [0.25, 0.1]
    assert all(torch.equal(p.detach(), m) for p, m in zip(params, masters, strict=True))


def test_docstring_example_runs() -> None:
    tests = [t for t in doctest.DocTestFinder().find(outer.DelayedNesterov, "DelayedNesterov", globs={}) if t.examples]
    assert tests
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_the_default_outer_steps_per_mode() -> None:
    """outer_momentum=None: Nesterov at DiLoCo's lr 0.7 with β = 0.5 (a steady step of 0.7 / (1 − 0.5) = 1.4× the
    mean delta, not DiLoCo's 7×); LAMB at 0.04 per round (0.04 / W per async merge) with β1 = 0.9. A given
    value is used as given, for either outer."""
    from ivyplug.optim import LocalUpdates

    def build(mode: str, **kw: Any) -> torch.optim.Optimizer:
        x = torch.nn.Parameter(torch.zeros(3))
        return LocalUpdates(torch.optim.SGD([x], lr=0.1), **kw).outer_optimizer(mode, 2)

    sync = build("sync", outer="nesterov")
    assert (sync.defaults["lr"], sync.defaults["momentum"], sync.defaults["nesterov"]) == (0.7, 0.5, True)
    steady = sync.defaults["lr"] / (1 - sync.defaults["momentum"])
    assert steady == pytest.approx(1.4)
    delayed = build("async", outer="nesterov")
    assert type(delayed) is DelayedNesterov
    assert delayed.defaults == {"lr": 0.7, "momentum": 0.5, "momentum_every": 2}
    assert build("sync", outer="nesterov", outer_momentum=0.9).defaults["momentum"] == 0.9
    lamb_sync, lamb_async = build("sync", outer="lamb"), build("async", outer="lamb")
    assert (lamb_sync.defaults["lr"], lamb_async.defaults["lr"]) == (0.04, 0.02)
    assert lamb_sync.defaults["betas"] == (0.9, 0.999)
    assert build("async", outer="lamb", outer_momentum=0.5).defaults["betas"] == (0.5, 0.999)
    with pytest.raises(ValueError, match=r"outer_momentum must be a number in \[0, 1\)"):
        build("sync", outer="nesterov", outer_momentum=1.0)
