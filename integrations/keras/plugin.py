"""ivyplug's registry plugin for Keras components: only ``"module:attr"`` strings, no Keras import."""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.components import Callback, Optimizer
from ivyplug.hookspecs import hookimpl


@hookimpl
def ivyplug_optimizers() -> Iterator[Optimizer]:
    yield Optimizer(
        "lamb",
        "ivyplug.integrations.keras.lamb:LAMB",
        framework="keras",
        description="LAMB with a bounded trust ratio; global-norm clipping after the cross-replica sum",
    )


@hookimpl
def ivyplug_callbacks() -> Iterator[Callback]:
    yield Callback(
        "ivy_load_balancer",
        "ivyplug.integrations.keras.load_balancer:IvyLoadBalancer",
        framework="keras",
        description="load-aware global batch size and LR rescaling inside model.fit (any tf.distribute strategy)",
    )
