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
    yield Optimizer(
        "async_lamb",
        "ivyplug.integrations.keras.async_lamb:AsyncLAMB",
        framework="keras",
        description="LAMB with local steps; workers average deltas through the PS (with AsyncLAMBExchange)",
    )


@hookimpl
def ivyplug_callbacks() -> Iterator[Callback]:
    yield Callback(
        "ivy_load_balancer",
        "ivyplug.integrations.keras.load_balancer:IvyLoadBalancer",
        framework="keras",
        description="load-aware global batch size and LR rescaling inside model.fit (any tf.distribute strategy)",
    )
    yield Callback(
        "async_lamb_exchange",
        "ivyplug.integrations.keras.async_lamb:AsyncLAMBExchange",
        framework="keras",
        description="AsyncLAMB's delta exchanges with ivyplug's parameter server during model.fit",
    )
