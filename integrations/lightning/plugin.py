"""ivyplug registry plugin for the Lightning adapters.

Only ``"module:attr"`` strings live here, so listing components imports no framework.
"""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.components import Callback, Strategy
from ivyplug.hookspecs import hookimpl

_REGISTRATION = "ivyplug.integrations.lightning.registration"


@hookimpl
def ivyplug_strategies() -> Iterator[Strategy]:
    yield Strategy(
        "ivy_ps",
        f"{_REGISTRATION}:ivy_ps",
        framework="lightning",
        description="parameter-server training, asynchronous (Trainer(strategy='ivy_ps'))",
    )
    yield Strategy(
        "ivy_ps_sync",
        f"{_REGISTRATION}:ivy_ps_sync",
        framework="lightning",
        description="parameter-server training, synchronous (same math as DDP)",
    )
    yield Strategy(
        "ivy_ps_ssp",
        f"{_REGISTRATION}:ivy_ps_ssp",
        framework="lightning",
        description="parameter-server training, stale-synchronous (bounded staleness, default 4 steps)",
    )


@hookimpl
def ivyplug_callbacks() -> Iterator[Callback]:
    yield Callback(
        "ivy_load_balancer",
        "ivyplug.integrations.lightning.load_balancer:IvyLoadBalancer",
        framework="lightning",
        description="load-aware batch size, per-rank shares, LR rescaling, OOM recovery",
    )
