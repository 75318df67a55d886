"""ivyplug registry plugin for the Lightning adapters.

Only ``"module:attr"`` strings live here, so listing components imports no framework. The strategy names,
their defaults and descriptions are declared once, in :mod:`.registration` (standard library only), which
also registers them with Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.integrations.lightning import registration

from ivyplug.components import Callback, Strategy
from ivyplug.hookspecs import hookimpl


@hookimpl
def ivyplug_strategies() -> Iterator[Strategy]:
    for factory in registration.FACTORIES:
        target = f"{registration.__name__}:{factory.name}"
        yield Strategy(factory.name, target, framework="lightning", description=factory.description)


@hookimpl
def ivyplug_callbacks() -> Iterator[Callback]:
    yield Callback(
        "ivy_load_balancer",
        "ivyplug.integrations.lightning.load_balancer:IvyLoadBalancer",
        framework="lightning",
        description="load-aware batch size, per-rank shares, LR rescaling, OOM recovery",
    )
