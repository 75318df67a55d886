"""Loading what torch.optim.Adam loads (groups lacking keys, numeric steps) and step hooks running once per step.

torch's load_state_dict reuses the saved tensors where it can, so every state dict below is deep-copied before a
second optimizer loads it (the twins would otherwise share moments and step counters).
"""

from __future__ import annotations

import copy
import inspect
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ivyplug.optim import LAMB, AsyncLAMB, lamb_param_groups
from ivyplug.optim import optimizer as lamb_module
from ivyplug.ps import PSConfig

Factory = Callable[[nn.Module], torch.optim.Optimizer]

# Non-default values everywhere, so that a key filled from the global defaults instead of the configured group
# would change the continued run.
_LAMB_KW: dict[str, Any] = {
    "lr": 0.02,
    "betas": (0.85, 0.99),
    "eps": 1e-5,
    "bias_correction": False,
    "max_trust_ratio": 3.0,
    "min_trust_ratio": 0.05,
    "max_grad_norm": 2.0,
}
_LAMB_ONLY_KEYS = ["foreach", "bias_correction", "max_trust_ratio", "min_trust_ratio", "exclude_from_layer_adaptation"]
_ALL_KEYS = [*_LAMB_ONLY_KEYS, "betas", "eps", "weight_decay"]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _lamb(foreach: bool | None) -> Factory:
    return lambda m: LAMB(lamb_param_groups(m, weight_decay=0.05), foreach=foreach, **_LAMB_KW)


def _async_lamb(foreach: bool | None) -> Factory:
    return lambda m: AsyncLAMB(
        lamb_param_groups(m, weight_decay=0.05), foreach=foreach, sync_every=3, merge_rate=0.5, **_LAMB_KW
    )


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=0.01, foreach=False)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _resume_twice(factory: Factory, edit: Callable[[dict[str, Any]], None]) -> tuple[nn.Module, nn.Module]:
    """Train, checkpoint, resume one twin from the checkpoint and one from ``edit``'s version; train both on."""
    model = _model(0)
    opt = factory(model)
    _train(model, opt, 6, seed=1)
    ckpt = copy.deepcopy(opt.state_dict())
    edited = copy.deepcopy(ckpt)
    edit(edited)
    twins = []
    for sd in (ckpt, edited):
        resumed = _model(7)
        resumed.load_state_dict(model.state_dict())
        resumed_opt = factory(resumed)
        resumed_opt.load_state_dict(sd)
        _train(resumed, resumed_opt, 5, seed=2)
        twins.append(resumed)
    return twins[0], twins[1]


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _drop(keys: list[str]) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        for group in sd["param_groups"]:
            for key in keys:
                group.pop(key, None)

    return edit


def _numeric_steps(kind: type) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        for state in sd["state"].values():
            state["step"] = kind(state["step"].item())

    return edit


FACTORIES = {
    "lamb-auto": _lamb(None),
    "lamb-loop": _lamb(False),
    "async_lamb-auto": _async_lamb(None),
    "async_lamb-loop": _async_lamb(False),
}


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("keys", [["foreach"], _LAMB_ONLY_KEYS, _ALL_KEYS], ids=["foreach", "lamb_keys", "all"])
def test_a_group_without_some_keys_loads_and_continues_identically(name: str, keys: list[str]) -> None:
    plain, edited = _resume_twice(FACTORIES[name], _drop(keys))
    _assert_same(plain, edited)


def test_adam_control_loads_a_group_without_foreach() -> None:
    plain, edited = _resume_twice(_adam, _drop(["foreach"]))
    _assert_same(plain, edited)


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("kind", [int, float])
def test_a_python_number_step_loads_and_continues_identically(name: str, kind: type) -> None:
    plain, edited = _resume_twice(FACTORIES[name], _numeric_steps(kind))
    _assert_same(plain, edited)


@pytest.mark.parametrize("kind", [int, float])
def test_adam_control_loads_a_python_number_step(kind: type) -> None:
    plain, edited = _resume_twice(_adam, _numeric_steps(kind))
    _assert_same(plain, edited)


def test_a_loaded_numeric_step_becomes_the_float32_counter() -> None:
    model = _model(0)
    opt = LAMB(model.parameters())
    _train(model, opt, 3, seed=1)
    sd = copy.deepcopy(opt.state_dict())
    _numeric_steps(int)(sd)
    sd["state"][1]["step"] = torch.tensor([3], dtype=torch.int64)  # another tensor form: shape (1,), int64
    fresh = LAMB(model.parameters())
    fresh.load_state_dict(sd)
    for state in fresh.state.values():
        step = state["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.shape == ()
        assert step.item() == 3.0


def test_a_missing_key_keeps_the_configured_group_value_and_present_keys_win() -> None:
    model = _model(0)
    opt = LAMB(lamb_param_groups(model), lr=0.03, max_trust_ratio=4.0)
    sd = copy.deepcopy(opt.state_dict())
    _drop(_ALL_KEYS)(sd)
    fresh = LAMB(lamb_param_groups(model), lr=0.5, max_trust_ratio=4.0, foreach=False)
    fresh.load_state_dict(sd)
    adapted, excluded = fresh.param_groups
    assert adapted["lr"] == excluded["lr"] == 0.03  # saved: from the checkpoint
    assert adapted["max_trust_ratio"] == 4.0 and adapted["foreach"] is False  # missing: from the replaced group
    assert excluded["exclude_from_layer_adaptation"] is True and excluded["weight_decay"] == 0.0


def test_group_defaults_match_the_constructor() -> None:
    sig = inspect.signature(LAMB.__init__).parameters
    expected = {k: sig[k].default for k in lamb_module._GROUP_DEFAULTS if k in sig}
    expected["exclude_from_layer_adaptation"] = False
    assert expected == lamb_module._GROUP_DEFAULTS
    assert LAMB(_model(0).parameters()).defaults == lamb_module._GROUP_DEFAULTS


def test_an_old_pickle_without_the_keys_fills_them_from_the_defaults() -> None:
    model = _model(0)
    opt = LAMB(model.parameters())
    _train(model, opt, 3, seed=1)
    state = copy.deepcopy(opt.__getstate__())
    for key in _ALL_KEYS:
        state["defaults"].pop(key)
        for group in state["param_groups"]:
            group.pop(key)
    for param_state in state["state"].values():
        param_state["step"] = int(param_state["step"].item())
    old = LAMB.__new__(LAMB)
    old.__setstate__(state)
    twin = copy.deepcopy(opt)
    for o in (old, twin):
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            for p in o.param_groups[0]["params"]:
                p.grad = torch.randn(p.shape, generator=gen)
            o.step()
    for p, q in zip(old.param_groups[0]["params"], twin.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_async_lamb_load_keeps_its_ps_and_merge_rate() -> None:
    model = _model(0)
    opt = AsyncLAMB(model.parameters(), lr=0.02, sync_every=2, merge_rate=0.5)
    client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    try:
        _train(model, opt, 3, seed=1)
        assert opt.exchanges == 1 and opt.local_steps == 1
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        opt.load_state_dict(torch.load(buf, weights_only=True))
        assert opt.attached and opt.merge_rate == 0.5 and opt.exchanges == 1 and opt.local_steps == 1
        _train(model, opt, 3, seed=2)
        assert opt.exchanges == 3 and client.metrics()["pushes"] == 3
    finally:
        client.close()


# -- step hooks -------------------------------------------------------------------------------------------------


class _Counter:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.pre = self.post = self.global_pre = self.global_post = 0

    def hooks(self) -> Iterator[Any]:
        """Register the four hooks; each counts calls for ``opt`` only (the PS's outer SGD steps too)."""

        def count(attr: str) -> Callable[..., None]:
            def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                if opt is self.opt:
                    setattr(self, attr, getattr(self, attr) + 1)

            return hook

        yield self.opt.register_step_pre_hook(count("pre"))
        yield self.opt.register_step_post_hook(count("post"))
        yield register_optimizer_step_pre_hook(count("global_pre"))
        yield register_optimizer_step_post_hook(count("global_post"))

    def counts(self) -> tuple[int, int, int, int]:
        return self.pre, self.post, self.global_pre, self.global_post


@pytest.mark.parametrize(
    ("cls", "attached"), [(LAMB, False), (AsyncLAMB, False), (AsyncLAMB, True)], ids=["lamb", "async", "async-ps"]
)
def test_step_hooks_run_once_per_step(cls: type[LAMB], attached: bool) -> None:
    # Either class created first: torch wraps each class's step in the hook runner at its first instance.
    LAMB(_model(1).parameters())
    AsyncLAMB(_model(1).parameters())
    model = _model(0)
    opt = cls(model.parameters(), lr=0.02)
    client = None
    if attached:
        assert isinstance(opt, AsyncLAMB)
        opt.sync_every = 2
        client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
    counter = _Counter(opt)
    handles = list(counter.hooks())
    try:
        _train(model, opt, 3, seed=1)
        assert counter.counts() == (3, 3, 3, 3)
        if isinstance(opt, AsyncLAMB) and attached:
            assert opt.exchanges == 1
    finally:
        for handle in handles:
            handle.remove()
        if client is not None:
            client.close()


@pytest.mark.parametrize("cls", [LAMB, AsyncLAMB])
def test_lr_scheduler_sees_the_step_and_hooks_still_run_once(cls: type[LAMB]) -> None:
    LAMB(_model(1).parameters())
    model = _model(0)
    opt = cls(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = _Counter(opt)
    handles = list(counter.hooks())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                _train(model, opt, 1, seed=i)
                sched.step()
        assert not [w for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step" in str(w.message)]
        assert getattr(opt, "_opt_called", False) and hasattr(opt.step, "_wrapped_by_lr_sched")
        assert counter.counts() == (4, 4, 4, 4)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    finally:
        for handle in handles:
            handle.remove()
