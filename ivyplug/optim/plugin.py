"""Registers ivyplug's torch optimizers; holds only "module:attr" strings (imports no framework)."""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.components import Optimizer
from ivyplug.hookspecs import hookimpl


@hookimpl
def ivyplug_optimizers() -> Iterator[Optimizer]:
    yield Optimizer(
        "lamb",
        "ivyplug.optim.optimizer:LAMB",
        framework="torch",
        description="LAMB (You et al. 2020, Alg. 2) with a clipped layer-wise trust ratio",
    )
    yield Optimizer(
        "async_lamb",
        "ivyplug.localsgd.async_lamb:AsyncLAMB",
        framework="torch",
        description="LAMB with local steps; workers average their deltas through the ivyplug parameter server",
    )
