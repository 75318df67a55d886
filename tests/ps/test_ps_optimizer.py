"""``PSOptimizer``: the PS step as an optimizer wrapper (ps/worker/optimizer.py), in one process against a plain
torch reference: ``step(closure)`` takes the wrapped optimizer's step on the servers; with several optimizers
each step moves only its own parameters; an LR scheduler bound to the wrapped optimizer works; misuse is refused
by name."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from ivyplug.ps import PSClient, PSConfig, PSOptimizer
from ivyplug.ps.worker.optimizer import served_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _gan(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)), nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1))


def _named(g: nn.Module, d: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"g.{n}", p) for n, p in g.named_parameters()] + [(f"d.{n}", p) for n, p in d.named_parameters()]


def _d_loss(g: nn.Module, d: nn.Module, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = g(z).detach()
    return bce(d(real), torch.ones(len(real), 1)) + bce(d(fake), torch.zeros(len(fake), 1))


def _g_loss(g: nn.Module, d: nn.Module, z: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(d(g(z)), torch.ones(len(z), 1))


def _adams(g: nn.Module, d: nn.Module) -> tuple[torch.optim.Adam, torch.optim.Adam]:
    return torch.optim.Adam(g.parameters(), lr=2e-2, betas=(0.5, 0.999)), torch.optim.Adam(d.parameters(), lr=1e-2)


def test_a_gan_s_two_optimizers_step_through_the_ps_as_torch_steps_them() -> None:
    """Generator and discriminator, one Adam each, alternating steps with the other's gradients left in place:
    each PS step moves exactly its own optimizer's parameters, as the plain torch optimizers do."""
    g, d = _gan(0)
    ref_g, ref_d = _gan(0)
    opt_g, opt_d = _adams(g, d)
    ref_opt_g, ref_opt_d = _adams(ref_g, ref_d)
    client = PSClient.start(PSConfig(mode="sync"), _named(g, d), optimizer=served_optimizer([opt_g, opt_d]))
    try:
        ps_g, ps_d = PSOptimizer(opt_g, client), PSOptimizer(opt_d, client)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            real, z = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
            for model_g, model_d, o_g, o_d in ((g, d, ps_g, ps_d), (ref_g, ref_d, ref_opt_g, ref_opt_d)):
                o_d.zero_grad()
                _d_loss(model_g, model_d, real, z).backward()
                generator_grads = [p.grad for p in model_g.parameters()]  # (None: detached)
                o_d.step()
                assert [p.grad for p in model_g.parameters()] == generator_grads
                o_g.zero_grad()
                _g_loss(model_g, model_d, z).backward()  # also leaves gradients in the discriminator
                kept = [p.grad.clone() for p in model_d.parameters() if p.grad is not None]
                o_g.step()
                torch.testing.assert_close([p.grad for p in model_d.parameters()], kept, rtol=0, atol=0)
            for p, q in zip(
                [*g.parameters(), *d.parameters()], [*ref_g.parameters(), *ref_d.parameters()], strict=True
            ):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        with torch.no_grad():
            start = _gan(0)[0].parameters()
            moved = [float((p - q).abs().max()) for p, q in zip(g.parameters(), start, strict=True)]
        assert min(moved) > 1e-3  # it trained
    finally:
        client.close()


class _Masked(nn.Module):
    """Multiplies by a constant mask buffer, which backward reads (saved by the multiplication)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mask", (torch.arange(n) % 3 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


@pytest.mark.parametrize(
    ("width", "cfg"),
    [
        (6, {"mode": "sync"}),
        # a server process over gloo, the generator's 1024x1024 weight received in place (wire/segments.py)
        (1024, {"mode": "async", "num_servers": 1, "shared_memory": False, "timeout": 60}),
    ],
)
def test_a_step_of_one_optimizer_leaves_the_others_parameters_and_their_graph_alone(
    width: int, cfg: dict[str, Any]
) -> None:
    """The usual DCGAN order: ``fake = G(z)``, the discriminator's step on ``fake.detach()``, then the generator's
    loss on the same ``fake``. The discriminator's step must not write the generator's parameters, whose autograd
    versions that graph checks, nor a buffer it did not change (the generator's mask, which backward reads); its
    reply wrote every parameter, and the generator's backward raised "modified by an inplace operation". Each step
    still equals torch's own optimizers stepped in the same order."""

    def gan() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        hidden = 1024 if width > 6 else 8
        g = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), _Masked(hidden), nn.Linear(hidden, width))
        return g, nn.Sequential(nn.Linear(width, 5), nn.Linear(5, 1))

    bce = nn.functional.binary_cross_entropy_with_logits
    (g, d), (ref_g, ref_d) = gan(), gan()
    opt_g, opt_d = _adams(g, d)
    ref_opt_g, ref_opt_d = _adams(ref_g, ref_d)
    buffers = [(f"g.{n}", b) for n, b in g.named_buffers()]
    client = PSClient.start(PSConfig(**cfg), _named(g, d), buffers, optimizer=served_optimizer([opt_g, opt_d]))
    try:
        client.pull_initial()
        ps_g, ps_d = PSOptimizer(opt_g, client), PSOptimizer(opt_d, client)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            real, z = torch.randn(8, width, generator=gen), torch.randn(8, 4, generator=gen)
            for model_g, model_d, o_g, o_d in ((g, d, ps_g, ps_d), (ref_g, ref_d, ref_opt_g, ref_opt_d)):
                fake = model_g(z)
                o_d.zero_grad()
                d_loss = bce(model_d(real), torch.ones(8, 1)) + bce(model_d(fake.detach()), torch.zeros(8, 1))
                d_loss.backward()
                before = [(p._version, p.detach().clone()) for p in [*model_g.parameters(), *model_g.buffers()]]
                o_d.step()
                after = [(p._version, p.detach()) for p in [*model_g.parameters(), *model_g.buffers()]]
                assert [v for v, _ in after] == [v for v, _ in before]
                torch.testing.assert_close([t for _, t in after], [t for _, t in before], rtol=0, atol=0)
                o_g.zero_grad()
                bce(model_d(fake), torch.ones(8, 1)).backward()  # through the graph built before o_d.step()
                o_g.step()
            for p, q in zip(
                [*g.parameters(), *d.parameters()], [*ref_g.parameters(), *ref_d.parameters()], strict=True
            ):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            moved = [float((p - q).abs().max()) for p, q in zip(g.parameters(), gan()[0].parameters(), strict=True)]
        assert min(moved) > 1e-3  # the generator trained
    finally:
        client.close()


def test_step_runs_the_closure_and_a_scheduler_on_the_wrapped_optimizer_works() -> None:
    """One optimizer (the served one): ``step(closure)`` returns the closure's loss; a StepLR bound to the wrapped
    SGD changes the servers' learning rate and warns of nothing; the worker's SGD keeps no state of its own."""
    torch.manual_seed(3)
    model, ref = nn.Linear(5, 2), nn.Linear(5, 2)
    ref.load_state_dict(model.state_dict())
    sgd, ref_sgd = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
    )
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_sgd, step_size=2, gamma=0.1)
    client = PSClient.start(PSConfig(mode="sync"), list(model.named_parameters()), optimizer=sgd)
    try:
        opt = PSOptimizer(sgd, client)
        gen = torch.Generator().manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a scheduler step "before the optimizer's" would warn
            for _ in range(5):
                x = torch.randn(6, 5, generator=gen)
                losses: list[Any] = []
                for m, o in ((model, opt), (ref, ref_sgd)):

                    def closure(m: nn.Module = m, o: Any = o, x: torch.Tensor = x) -> torch.Tensor:
                        o.zero_grad()
                        loss = m(x).pow(2).mean()
                        loss.backward()
                        return loss

                    losses.append(o.step(closure))
                torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
                sched.step()
                ref_sched.step()
        torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7)
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.001)
        assert len(opt.state) == 0 and opt.param_groups is sgd.param_groups
        assert opt.state_dict()["param_groups"] == sgd.state_dict()["param_groups"]
    finally:
        client.close()


def test_misuse_is_refused_by_name() -> None:
    g, d = _gan(0)
    with pytest.raises(ValueError, match=r"must be of one class.*Adam, SGD"):
        served_optimizer([torch.optim.Adam(g.parameters()), torch.optim.SGD(d.parameters(), lr=0.1)])
    with pytest.raises(ValueError, match="is in optimizers 0 and 1"):
        served_optimizer([torch.optim.Adam(g.parameters()), torch.optim.Adam([*d.parameters(), *g.parameters()])])
    with pytest.raises(ValueError, match="at least one optimizer"):
        served_optimizer([])
    opt_g, opt_d = _adams(g, d)
    client = PSClient.start(PSConfig(mode="sync"), [(f"g.{n}", p) for n, p in g.named_parameters()], optimizer=opt_g)
    try:
        with pytest.raises(ValueError, match="does not hold"):
            PSOptimizer(opt_d, client)
        with pytest.raises(ValueError, match="cannot take a new param group"):
            PSOptimizer(opt_g, client).add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    finally:
        client.close()
