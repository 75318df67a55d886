"""The plugin registry: built-in components first, then the ``ivyplug`` entry points.

Built-ins are registered through the same hooks a third-party package uses. Loading
is isolated per plugin: one that fails to import or whose hook raises is recorded
in :attr:`Registry.errors` with the package that shipped it, and the rest load. A name
that two plugins offer is recorded there too, and asking for it is an error naming both;
every other name still resolves.
Set ``IVYPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` to skip entry points.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from ivyplug import hookspecs
from ivyplug.components import KIND_TYPES, KINDS, Component

ENTRY_POINT_GROUP = "ivyplug"
DISABLE_AUTOLOAD_ENV = "IVYPLUG_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_PROVIDER = "ivyplug"

#: Modules of ivyplug's own plugins, registered in this order.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "ivyplug.optim.plugin",
    "ivyplug.integrations.keras.plugin",
    "ivyplug.load.plugin",
    "ivyplug.integrations.lightning.plugin",
)

_HOOK_FOR_KIND = {
    "strategy": "ivyplug_strategies",
    "optimizer": "ivyplug_optimizers",
    "callback": "ivyplug_callbacks",
    "probe": "ivyplug_probes",
}


class RegistryError(Exception):
    """Base class of registry errors."""


class UnknownComponentError(RegistryError, KeyError):
    """A name that no plugin provides (the message lists the available names)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class AmbiguousComponentError(RegistryError, KeyError):
    """A bare name that matches components of several frameworks."""

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateComponentError(RegistryError):
    """Two plugins offer the same component name."""


class ComponentUnavailableError(RegistryError, ImportError):
    """A known component whose framework is not installed."""


@dataclass(frozen=True)
class PluginError:
    """A plugin that could not be loaded or whose hook raised."""

    plugin: str
    provider: str
    error: BaseException

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} from package {self.provider!r} failed: {self.error!r}"


@dataclass(frozen=True)
class Entry:
    """A registered component and where it came from."""

    component: Component
    provider: str
    plugin: str

    @property
    def kind(self) -> str:
        return self.component.kind

    @property
    def name(self) -> str:
        return self.component.full_name

    @property
    def missing(self) -> list[str]:
        return self.component.missing_modules()

    @property
    def available(self) -> bool:
        return not self.missing

    def install_hint(self) -> str:
        extra = self.component.install_extra
        missing = ", ".join(self.missing)
        if extra:  # the extra is one of the package that ships the component
            return f"needs {missing}: pip install '{self.provider}[{extra}]'"
        return f"needs {missing}"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")


class Registry:
    """Components by kind and full name; built by :func:`build_registry`."""

    def __init__(self, plugin_manager: pluggy.PluginManager) -> None:
        self.plugin_manager = plugin_manager
        self.errors: list[PluginError] = []
        self._entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        #: names offered twice (the first provider's entry stays listed; asking for the name is the error)
        self._conflicts: dict[str, dict[str, DuplicateComponentError]] = {k: {} for k in KINDS}

    def add(self, entry: Entry) -> None:
        """Add one entry; a second provider of the same name is an error naming both."""
        table = self._entries[entry.kind]
        key = entry.name.lower()
        previous = table.get(key)
        if previous is not None:
            raise DuplicateComponentError(
                f"{entry.kind} {entry.name!r} is provided twice: by package {previous.provider!r} "
                f"(plugin {previous.plugin!r}) and by package {entry.provider!r} (plugin {entry.plugin!r}); "
                "uninstall one of them"
            )
        table[key] = entry

    def add_or_record(self, entry: Entry) -> None:
        """:meth:`add`, but a name offered twice is recorded, not raised: the later plugin's error (reported as a
        failed plugin is), and the name an error naming both when asked for (:meth:`resolve`), while every
        other name still resolves."""
        try:
            self.add(entry)
        except DuplicateComponentError as exc:
            self._conflicts[entry.kind][entry.name.lower()] = exc
            self.errors.append(PluginError(entry.plugin, entry.provider, exc))

    def names(self, kind: str) -> list[str]:
        """Sorted full names of every registered component of ``kind``."""
        _check_kind(kind)
        return sorted(e.name for e in self._entries[kind].values())

    def entries(self, kind: str | None = None) -> list[Entry]:
        kinds = KINDS if kind is None else (kind,)
        for k in kinds:
            _check_kind(k)
        return [e for k in kinds for _, e in sorted(self._entries[k].items())]

    def resolve(self, kind: str, name: str) -> Entry:
        """Find an entry by full name (``torch.lamb``) or by an unambiguous bare name (``lamb``)."""
        _check_kind(kind)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        table = self._entries[kind]
        key = name.lower()
        if key in table:
            return self._unique(table[key])
        matches = [e for e in table.values() if e.component.name.lower() == key]
        if len(matches) == 1:
            return self._unique(matches[0])
        if len(matches) > 1:
            options = ", ".join(sorted(e.name for e in matches))
            raise AmbiguousComponentError(
                f"{kind} name {name!r} is ambiguous: it matches {options}; use one of those full names"
            )
        available = ", ".join(self.names(kind)) or "(none)"
        shorts = [e.component.name.lower() for e in table.values()]
        unique = [
            e.component.name for e in table.values() if "." in e.name and shorts.count(e.component.name.lower()) == 1
        ]
        hint = f" (or without the framework's prefix where unambiguous: {sorted(unique)[0]})" if unique else ""
        raise UnknownComponentError(f"unknown {kind} {name!r}; available {kind} names: {available}{hint}")

    def _unique(self, entry: Entry) -> Entry:
        """``entry``, unless another plugin offers its name too (DuplicateComponentError naming both)."""
        conflict = self._conflicts[entry.kind].get(entry.name.lower())
        if conflict is not None:
            raise DuplicateComponentError(*conflict.args)
        return entry

    def get(self, kind: str, name: str, *, builtin: bool = False) -> Any:
        """Import and return the component object (a class, usually). ``builtin``: ``name`` is a full name of
        ivyplug's own (what ivyplug picks by default), taken whatever other plugins offer."""
        if builtin:
            _check_kind(kind)
            entry = self._entries[kind].get(name.lower())
            if entry is None or entry.provider != BUILTIN_PROVIDER:
                raise UnknownComponentError(f"{kind} {name!r} is not one of ivyplug's own")
        else:
            entry = self.resolve(kind, name)
        if not entry.available:
            raise ComponentUnavailableError(f"{kind} {entry.name!r} is not available: {entry.install_hint()}")
        return entry.component.load()


def _provider_of(module_or_obj: object) -> str:
    return getattr(module_or_obj, "__name__", type(module_or_obj).__name__)


def _collect(registry: Registry, pm: pluggy.PluginManager, plugin_name: str, provider: str) -> None:
    """Call each hook implementation of one plugin, as the plugin manager holds them, in isolation so that a
    failure is attributed to that plugin (``pm.hook.<name>()`` would stop at the first that raises)."""
    collected: list[Entry] = []
    try:
        for kind, hook_name in _HOOK_FOR_KIND.items():
            impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if i.plugin_name == plugin_name]
            if not impls:
                continue
            result: Iterable[Component] | None = impls[0].function()
            for component in result or ():
                expected = KIND_TYPES[kind]
                if not isinstance(component, expected):
                    raise TypeError(
                        f"{hook_name} must yield {expected.__module__}.{expected.__name__} records, got {component!r}"
                    )
                collected.append(Entry(component, provider, plugin_name))
    except Exception as exc:
        registry.errors.append(PluginError(plugin_name, provider, exc))
        return
    for entry in collected:
        registry.add_or_record(entry)


def _drop_invalid(pm: pluggy.PluginManager, registry: Registry, loaded: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The plugins of ``loaded`` whose every hook is one of ivyplug's (pluggy's ``check_pending``): one with a hook
    no spec names (a misspelt ``ivyplug_probe``) is unregistered and reported, and the others still load. A built-in
    plugin's is ivyplug's own bug: raised."""
    while True:
        try:
            pm.check_pending()
            return loaded
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin)
            provider = next((p for n, p in loaded if n == name), None)
            if provider is None or provider == BUILTIN_PROVIDER:
                raise
            pm.unregister(exc.plugin)
            registry.errors.append(PluginError(str(name), provider, exc))
            loaded = [(n, p) for n, p in loaded if n != name]


def build_registry(autoload: bool | None = None, builtins: Iterable[str] | None = None) -> Registry:
    """Build a fresh registry (``get_registry()`` caches one per process).

    ``autoload=None`` reads ``IVYPLUG_DISABLE_PLUGIN_AUTOLOAD``; ``builtins`` overrides the
    built-in plugin modules (for tests).
    """
    if autoload is None:
        autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes", "on")
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm)

    loaded: list[tuple[str, str]] = []  # (plugin name, provider), in load order
    for module_name in BUILTIN_PLUGINS if builtins is None else builtins:
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
        loaded.append((module_name, BUILTIN_PROVIDER))

    if autoload:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            provider = ep.dist.name if ep.dist is not None else ep.value.split(":")[0]
            if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                registry.errors.append(
                    PluginError(ep.name, provider, RegistryError(f"plugin name {ep.name!r} is already taken"))
                )
                continue
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
            except Exception as exc:
                registry.errors.append(PluginError(ep.name, provider, exc))
                continue
            loaded.append((ep.name, provider))

    loaded = _drop_invalid(pm, registry, loaded)
    for plugin_name, provider in loaded:
        _collect(registry, pm, plugin_name, provider)
    for err in registry.errors:
        warnings.warn(f"ivyplug: {err}", RuntimeWarning, stacklevel=2)
    return registry


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry()
        return _registry


def reset_registry() -> None:
    """Forget the cached registry (the next ``get_registry()`` rebuilds it)."""
    global _registry
    with _lock:
        _registry = None
