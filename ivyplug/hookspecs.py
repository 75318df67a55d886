"""The ivyplug hook specifications: one hook per kind of component.

A plugin is any module or object with functions marked ``@hookimpl``; it is found
through the ``ivyplug`` entry-point group. Each hook returns an iterable of the
frozen records in :mod:`ivyplug.components`.
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from ivyplug.components import Callback, Optimizer, Probe, Strategy

PROJECT_NAME = "ivyplug"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def ivyplug_strategies() -> Iterable[Strategy]:
    """Contribute training strategies.

    The registry lists them (``ivyplug list``) and hands out their classes
    (``ivyplug.get_registry().get("strategy", "my_ps")``); ``Trainer(strategy="...")`` strings are Lightning's
    own registry, where ivyplug registers its own strategies only: a plugin that wants a string name registers
    it there itself (``lightning.pytorch.strategies.StrategyRegistry.register``).

    Example::

        @ivyplug.hookimpl
        def ivyplug_strategies():
            yield Strategy("my_ps", "my_pkg.strategy:MyPS", framework="lightning")
    """


@hookspec
def ivyplug_optimizers() -> Iterable[Optimizer]:
    """Contribute optimizers.

    Example::

        @ivyplug.hookimpl
        def ivyplug_optimizers():
            yield Optimizer("lion", "my_pkg.lion:Lion", framework="torch")
    """


@hookspec
def ivyplug_callbacks() -> Iterable[Callback]:
    """Contribute training callbacks.

    Example::

        @ivyplug.hookimpl
        def ivyplug_callbacks():
            yield Callback("throttle", "my_pkg.cb:Throttle", framework="keras")
    """


@hookspec
def ivyplug_probes() -> Iterable[Probe]:
    """Contribute device-load probes (objects implementing ``ivyplug.load`` probe protocol).

    Example::

        @ivyplug.hookimpl
        def ivyplug_probes():
            yield Probe("rocm", "my_pkg.rocm:RocmProbe", requires=("pyrsmi",), extra="rocm")

    ``extra`` names an extra of the package that ships the probe (the install hint reads
    ``pip install 'my-pkg[rocm]'``).
    """
