"""The Lightning and Keras twins agree: IvyLoadBalancer option names, defaults, batch bounds and probes;
LAMB exclusion patterns matched by one rule. The old option name warns once and still works."""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import numpy as np
import pytest
from ivyplug.integrations.keras import lamb as keras_lamb
from ivyplug.integrations.keras import load_balancer as keras_lb
from ivyplug.integrations.keras.elastic import ElasticDataset
from ivyplug.integrations.lightning import load_balancer as lightning_lb

from ivyplug.load import DEFAULT_PROBE_NAMES, BatchSizePolicy, default_batch_bounds
from ivyplug.optim import groups as torch_groups

#: Options only one twin has, and why: Lightning spreads B over ranks and owns the DDP hook; Keras is handed
#: its data set and cannot learn the device TensorFlow runs on.
LIGHTNING_ONLY = {"balance_shares", "share_window", "comm_hook", "loss_reduction", "seed", "max_oom_splits"}
KERAS_ONLY = {"dataset", "device_index", "backup_dir"}  # backup_dir: Lightning keeps state in checkpoints


def _options(cls: type) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}


def test_shared_options_have_the_same_names_and_defaults() -> None:
    light, keras_ = _options(lightning_lb.IvyLoadBalancer), _options(keras_lb.IvyLoadBalancer)
    assert set(light) - LIGHTNING_ONLY == set(keras_) - KERAS_ONLY
    shared = set(light) - LIGHTNING_ONLY
    assert {n: light[n] for n in shared} == {n: keras_[n] for n in shared}
    assert "oom_max_parts" in shared and "probes" in shared
    # the same order too, so the two docstrings and signatures read alike
    assert [n for n in light if n in shared] == [n for n in keras_ if n in shared]


def test_the_ps_exchange_takes_the_strategys_options_in_its_order() -> None:
    from ivyplug.integrations.keras.async_lamb import AsyncLAMBExchange
    from ivyplug.integrations.lightning.ps_strategy import IvyPSStrategy

    strategy, exchange = _options(IvyPSStrategy), _options(AsyncLAMBExchange)
    assert set(exchange) <= set(strategy)
    assert list(exchange) == [n for n in strategy if n in exchange]
    assert {n: exchange[n] for n in exchange} == {n: strategy[n] for n in exchange}
    # positionally only what both take first: a third positional value cannot mean two things
    kinds = inspect.signature(AsyncLAMBExchange.__init__).parameters
    assert [n for n, p in kinds.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == ["self", "mode", "staleness"]
    with pytest.raises(TypeError):
        AsyncLAMBExchange("async", None, "inverse")  # type: ignore[misc]


def test_every_shared_option_is_documented_in_both_docstrings() -> None:
    for cls in (lightning_lb.IvyLoadBalancer, keras_lb.IvyLoadBalancer):
        doc = cls.__doc__ or ""
        for name in set(_options(cls)) - {"max_oom_splits"}:
            assert re.search(rf"\b{name}\b", doc), (cls.__module__, name)


def test_same_default_probes() -> None:
    assert keras_lb.DEFAULT_PROBES == DEFAULT_PROBE_NAMES
    assert keras_lb.IvyLoadBalancer().get_config()["probes"] == list(DEFAULT_PROBE_NAMES)
    assert lightning_lb.IvyLoadBalancer().probes is None  # setup() builds default_probes(DEFAULT_PROBE_NAMES)


def test_same_default_batch_bounds() -> None:
    light = lightning_lb.IvyLoadBalancer(grow_factor=3.0)
    light.batch_size, light._world = 32, 2
    policy = light._policy()
    data = ElasticDataset(np.zeros((4096, 2), "float32"), np.zeros(4096, "int32"), batch_size=32)
    keras_ = keras_lb.IvyLoadBalancer(data, grow_factor=3.0)
    keras_._replicas = lambda: 2  # type: ignore[method-assign]
    keras_._build_policy()
    assert (policy.min_batch_size, policy.max_batch_size) == default_batch_bounds(32, 2) == (2, 256)
    assert keras_.policy == policy  # bounds and the rules passed as keywords


def test_a_full_policy_overrides_bounds_and_rules_in_both() -> None:
    given = BatchSizePolicy(8, 64, cooldown=3)
    light = lightning_lb.IvyLoadBalancer(policy=given, max_batch_size=1000)
    light.batch_size = 32
    data = ElasticDataset(np.zeros((512, 2), "float32"), np.zeros(512, "int32"), batch_size=32)
    keras_ = keras_lb.IvyLoadBalancer(data, policy=given, max_batch_size=1000)
    keras_._build_policy()
    assert light._policy() is given and keras_.policy is given
    config = keras_.get_config()
    assert config["policy"]["cooldown"] == 3
    assert keras_lb.IvyLoadBalancer.from_config(config).get_config() == config


def test_old_option_name_works_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lightning_lb, "_warned", set())
    with pytest.warns(DeprecationWarning, match=r"max_oom_splits.*oom_max_parts") as record:
        cb = lightning_lb.IvyLoadBalancer(max_oom_splits=4)
    assert cb.oom_max_parts == 4
    assert sum(issubclass(w.category, DeprecationWarning) for w in record) == 1
    assert record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lightning_lb.IvyLoadBalancer(max_oom_splits=2).max_oom_splits == 2  # warned already
    with pytest.raises(ValueError, match="oom_max_parts"):
        lightning_lb.IvyLoadBalancer(max_oom_splits=0)


def test_oom_max_parts_bounds_agree() -> None:
    for cls in (lightning_lb.IvyLoadBalancer, keras_lb.IvyLoadBalancer):
        assert cls(oom_max_parts=1).oom_max_parts == 1  # 1: no splitting
        with pytest.raises(ValueError, match="oom_max_parts must be an int >= 1"):
            cls(oom_max_parts=0)


NAMES = ["dense/kernel", "dense/bias", "layer_norm/gamma", "encoder.0.bias", "encoder.0.weight", "LayerNorm.weight"]
PATTERNS: list[list[str]] = [
    ["bias"],
    ["norm"],
    ["Norm", "bias$"],
    [r"^encoder\.\d+\."],
    [r"/(gamma|beta)$"],
    ["kernel", "weight"],
    [],
]


@pytest.mark.parametrize("patterns", PATTERNS)
def test_lamb_exclusions_match_alike(patterns: list[str]) -> None:
    torch_answers = [torch_groups.matches_any(patterns, n) for n in NAMES]
    assert torch_answers == [keras_lamb.matches_any(patterns, n) for n in NAMES]
    assert torch_answers == [any(re.search(p, n) for p in patterns) for n in NAMES]
    assert torch_groups.check_patterns("x", patterns) == keras_lamb.check_patterns("x", patterns)


@pytest.mark.parametrize("bad", ["bias", ["("], [""], [1]])
def test_lamb_exclusions_refuse_alike(bad: Any) -> None:
    for check in (torch_groups.check_patterns, keras_lamb.check_patterns):
        with pytest.raises(ValueError, match="exclude_from_weight_decay"):
            check("exclude_from_weight_decay", bad)


def test_lamb_exclusions_select_the_same_layers() -> None:
    import keras
    import torch
    from ivyplug.integrations.keras import LAMB as KerasLAMB

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc"), keras.layers.Dense(2, name="head")])
    # unanchored: a Keras path starts with the model's name ("sequential/head/kernel"), a torch name does not
    opt = KerasLAMB(exclude_from_layer_adaptation=["bias"], exclude_from_weight_decay=["head"])
    opt.build(model.trainable_variables)
    keras_paths = [v.path for v in model.trainable_variables]
    keras_adapt = dict(zip(keras_paths, opt._adapt_flags, strict=True))
    keras_decay = dict(zip(keras_paths, opt._decay_flags, strict=True))

    net = torch.nn.Sequential()
    net.add_module("fc", torch.nn.Linear(4, 3))
    net.add_module("head", torch.nn.Linear(3, 2))
    groups = torch_groups.lamb_param_groups(
        net, exclude_1d=False, exclude_from_layer_adaptation=["bias"], exclude_from_weight_decay=["head"]
    )
    from ivyplug.optim import LAMB as TorchLAMB

    groups = TorchLAMB(groups).param_groups  # a group without weight_decay takes the optimizer's
    names = {id(p): n for n, p in net.named_parameters()}
    torch_adapt = {names[id(p)]: not g["exclude_from_layer_adaptation"] for g in groups for p in g["params"]}
    torch_decay = {names[id(p)]: g["weight_decay"] > 0 for g in groups for p in g["params"]}

    def as_torch_names(flags: dict[str, bool]) -> dict[str, bool]:
        return {
            k.removeprefix(f"{model.name}/").replace("/", ".").replace("kernel", "weight"): v for k, v in flags.items()
        }

    expected_adapt = {"fc.weight": True, "fc.bias": False, "head.weight": True, "head.bias": False}
    assert as_torch_names(keras_adapt) == torch_adapt == expected_adapt
    expected_decay = {"fc.weight": True, "fc.bias": True, "head.weight": False, "head.bias": False}
    assert as_torch_names(keras_decay) == torch_decay == expected_decay


#: a bad value, as (the torch LAMB's keyword, the Keras LAMB's keyword, the value, the name in the message)
BAD_LAMB_VALUES = [
    ({"lr": float("inf")}, {"learning_rate": float("inf")}, "a finite float >= 0, got inf"),
    ({"lr": True}, {"learning_rate": True}, "a finite float >= 0, got True"),
    ({"betas": (1.0, 0.999)}, {"beta_1": 1.0}, "in [0, 1), got 1.0"),
    ({"eps": float("nan")}, {"epsilon": float("nan")}, "a finite float > 0 (with 0, an element whose"),
    ({"eps": 0.0}, {"epsilon": 0.0}, "divides 0 by 0), got 0.0"),
    ({"weight_decay": -0.1}, {"weight_decay": -0.1}, "weight_decay must be a finite float >= 0, got -0.1"),
    ({"bias_correction": 1}, {"bias_correction": 1}, "bias_correction must be True or False, got 1"),
    ({"max_trust_ratio": 0.0}, {"max_trust_ratio": 0.0}, "max_trust_ratio must be a float > 0 (inf allowed), got 0.0"),
    ({"min_trust_ratio": float("inf")}, {"min_trust_ratio": float("inf")}, "min_trust_ratio must be a finite float"),
    (
        {"min_trust_ratio": 2.0, "max_trust_ratio": 1.0},
        {"min_trust_ratio": 2.0, "max_trust_ratio": 1.0},
        "min_trust_ratio (2.0) must be <= max_trust_ratio (1.0)",
    ),
    ({"max_grad_norm": float("inf")}, {"max_grad_norm": float("inf")}, "None or a finite float > 0, got inf"),
]


@pytest.mark.parametrize(("torch_kwargs", "keras_kwargs", "message"), BAD_LAMB_VALUES)
def test_both_lambs_refuse_a_bad_value_with_the_same_words(
    torch_kwargs: dict[str, Any], keras_kwargs: dict[str, Any], message: str
) -> None:
    import torch
    from ivyplug.integrations.keras import LAMB as KerasLAMB

    from ivyplug.optim import LAMB as TorchLAMB

    with pytest.raises(ValueError, match=re.escape(message)):
        TorchLAMB([torch.nn.Parameter(torch.zeros(2))], **torch_kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        KerasLAMB(**keras_kwargs)
