"""The Keras ``AsyncLAMB`` takes the torch one's outer options (names, defaults) and builds the same outer optimizer."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch

from ivyplug.optim import AsyncLAMB as TorchAsyncLAMB

keras = pytest.importorskip("keras")

OPTIONS = ("outer", "outer_lr", "outer_momentum", "outer_momentum_every")


def _keras_classes() -> tuple[Any, Any]:
    from ivyplug.integrations.keras.async_lamb import AsyncLAMB, AsyncLAMBExchange

    return AsyncLAMB, AsyncLAMBExchange


def test_same_names_and_defaults_and_config_round_trip() -> None:
    keras_cls, _ = _keras_classes()
    torch_sig, keras_sig = inspect.signature(TorchAsyncLAMB.__init__), inspect.signature(keras_cls.__init__)
    for name in OPTIONS:
        assert keras_sig.parameters[name].default == torch_sig.parameters[name].default, name
    opt = keras_cls(learning_rate=0.01, max_trust_ratio=3.0, outer="lamb", outer_lr=0.05, outer_momentum=0.7)
    config = opt.get_config()
    assert {k: config[k] for k in OPTIONS} == {
        "outer": "lamb",
        "outer_lr": 0.05,
        "outer_momentum": 0.7,
        "outer_momentum_every": None,
    }
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is keras_cls and again.outer_rule() == opt.outer_rule()
    twin = TorchAsyncLAMB(
        [torch.zeros(2, requires_grad=True)], max_trust_ratio=3.0, outer="lamb", outer_lr=0.05, outer_momentum=0.7
    )
    assert opt.outer_rule() == twin.rule


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"outer": "adam"}, "outer must be"),
        ({"outer": "nesterov", "outer_momentum_every": 0}, "outer_momentum_every must be None or an int >= 1"),
        ({"outer": "nesterov", "merge_rate": 0.5}, "merge_rate applies to outer='average' only"),
    ],
)
def test_bad_values_are_refused_when_built(kwargs: dict[str, Any], match: str) -> None:
    keras_cls, _ = _keras_classes()
    with pytest.raises(ValueError, match=match):
        keras_cls(**kwargs)


def test_the_exchange_callback_starts_the_ps_with_the_chosen_outer_optimizer() -> None:
    keras_cls, exchange_cls = _keras_classes()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras_cls(learning_rate=0.01, sync_every=2, outer="nesterov", outer_lr=0.5), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    exchange = exchange_cls(mode="sync")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[exchange])
    served = exchange._delta.outer
    assert type(served) is torch.optim.SGD and exchange.exchanges == 2
    assert (served.defaults["lr"], served.defaults["momentum"], served.defaults["nesterov"]) == (0.5, 0.5, True)
