"""The registry: built-ins, real entry points, duplicates, broken plugins, autoload off."""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path

import pytest

from ivyplug import registry as reg
from ivyplug.components import Callback, Optimizer, Probe, Strategy
from ivyplug.hookspecs import hookimpl


def _write_dist(root: Path, dist: str, module: str, ep_name: str, body: str) -> None:
    """A minimal installed distribution: a module plus a dist-info with entry_points.txt."""
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[ivyplug]\n{ep_name} = {module}\n")


THIRD_PARTY = """
from ivyplug.components import Probe
from ivyplug.hookspecs import hookimpl

@hookimpl
def ivyplug_probes():
    return [Probe("fancy", "json:dumps", description="third-party probe")]
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(reg.DISABLE_AUTOLOAD_ENV, raising=False)
    return tmp_path


def test_builtins_are_listed_and_loadable() -> None:
    registry = reg.build_registry(autoload=False)
    assert registry.errors == []
    for module_name in reg.BUILTIN_PLUGINS:
        contributed = [e for e in registry.entries() if e.plugin == module_name]
        assert contributed, f"built-in plugin {module_name} contributed nothing"
    for entry in registry.entries():
        assert entry.provider == "ivyplug"
        assert entry.name in registry.names(entry.kind)
        if entry.available:
            assert registry.get(entry.kind, entry.name) is not None


def test_third_party_entry_point_is_discovered(site: Path) -> None:
    _write_dist(site, "fancy-probe", "fancy_probe_plugin", "fancy", THIRD_PARTY)
    registry = reg.build_registry()
    entry = registry.resolve("probe", "fancy")
    assert entry.provider == "fancy-probe"
    assert "fancy" in registry.names("probe")
    import json

    assert registry.get("probe", "fancy") is json.dumps


def test_autoload_disabled_by_environment(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_dist(site, "fancy-probe", "fancy_probe_plugin2", "fancy", THIRD_PARTY)
    monkeypatch.setenv(reg.DISABLE_AUTOLOAD_ENV, "1")
    registry = reg.build_registry()
    assert "fancy" not in registry.names("probe")
    monkeypatch.setenv(reg.DISABLE_AUTOLOAD_ENV, "0")
    assert "fancy" in reg.build_registry().names("probe")


def test_duplicate_names_report_both_providers_and_the_rest_resolves(site: Path) -> None:
    """Two plugins offering one name: asking for it is an error naming both, reported as a failed plugin is (the
    registry was not built at all before: ``ivyplug list`` itself ended in a traceback), and every other name
    still resolves."""
    _write_dist(site, "probe-one", "probe_one_plugin", "one", THIRD_PARTY)
    _write_dist(site, "probe-two", "probe_two_plugin", "two", THIRD_PARTY)
    with pytest.warns(RuntimeWarning, match="provided twice"):
        registry = reg.build_registry()
    for ask in (lambda: registry.get("probe", "fancy"), lambda: registry.resolve("probe", "FANCY")):
        with pytest.raises(reg.DuplicateComponentError) as info:
            ask()
        assert "probe-one" in str(info.value) and "probe-two" in str(info.value) and "'fancy'" in str(info.value)
    (error,) = registry.errors  # the later of the two (entry points come in no set order)
    assert error.provider in ("probe-one", "probe-two") and isinstance(error.error, reg.DuplicateComponentError)
    assert registry.names("probe").count("fancy") == 1
    assert registry.get("optimizer", "torch.lamb").__name__ == "LAMB"
    assert registry.get("probe", "psutil").__name__ == "PsutilProbe"


SHADOWS = """
from ivyplug.components import Probe
from ivyplug.hookspecs import hookimpl

@hookimpl
def ivyplug_probes():
    yield Probe("torch_allocator", "json:JSONDecoder", description="a bare name equal to a built-in's short one")
    yield Probe("psutil", "json:JSONEncoder", description="a built-in's full name")
    yield Probe("nvml", "json:JSONDecoder", framework="keras", description="a built-in's name in another framework")
"""


def test_the_default_probes_are_ivyplugs_own_whatever_plugins_offer(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The balancers' default probes are ivyplug's, by full name: a plugin's bare ``torch_allocator`` replaced
    ivyplug's in every default ``IvyLoadBalancer``, and one under another framework made the default name
    ambiguous and every fit fail at start. A user naming the probe still gets the error naming both."""
    from ivyplug.load import probes as probes_module

    _write_dist(site, "shadow-pkg", "shadow_plugin", "shadow", SHADOWS)
    with pytest.warns(RuntimeWarning, match="shadow-pkg"):
        registry = reg.build_registry()
    monkeypatch.setattr(reg, "_registry", registry)
    built = {type(p).__module__ for p in probes_module.default_probes()}
    assert built <= {"ivyplug.load.nvml_probe", "ivyplug.load.torch_probe", "ivyplug.load.psutil_probe"}, built
    assert {"ivyplug.load.torch_probe", "ivyplug.load.psutil_probe"} <= built
    with pytest.raises(reg.DuplicateComponentError, match="shadow-pkg"):
        probes_module.make_probe("psutil")
    assert registry.get("probe", "torch_allocator") is json.JSONDecoder  # the plugin's, by its exact full name
    assert registry.resolve("probe", "keras.nvml").provider == "shadow-pkg"


def test_broken_plugin_is_reported_and_others_load(site: Path) -> None:
    _write_dist(site, "broken-pkg", "broken_plugin", "broken", "raise RuntimeError('boom at import')\n")
    _write_dist(site, "fancy-probe", "fancy_probe_plugin3", "fancy", THIRD_PARTY)
    with pytest.warns(RuntimeWarning, match="broken-pkg"):
        registry = reg.build_registry()
    assert "fancy" in registry.names("probe")
    assert [(e.plugin, e.provider) for e in registry.errors] == [("broken", "broken-pkg")]
    assert "boom at import" in str(registry.errors[0])


def test_hook_that_raises_is_isolated(site: Path) -> None:
    body = """
    from ivyplug.hookspecs import hookimpl
    @hookimpl
    def ivyplug_optimizers():
        raise ValueError("hook exploded")
    """
    _write_dist(site, "bad-hook", "bad_hook_plugin", "badhook", body)
    _write_dist(site, "fancy-probe", "fancy_probe_plugin4", "fancy", THIRD_PARTY)
    with pytest.warns(RuntimeWarning, match="hook exploded"):
        registry = reg.build_registry()
    assert "fancy" in registry.names("probe")
    assert registry.errors[0].provider == "bad-hook"


def test_a_plugin_with_a_misspelt_hook_is_reported_and_others_load(site: Path) -> None:
    body = """
    from ivyplug.components import Probe
    from ivyplug.hookspecs import hookimpl
    @hookimpl
    def ivyplug_probe():
        return [Probe("typo", "json:loads")]
    """
    _write_dist(site, "typo-pkg", "typo_hook_plugin", "typo", body)
    _write_dist(site, "fancy-probe", "fancy_probe_plugin5", "fancy", THIRD_PARTY)
    with pytest.warns(RuntimeWarning, match="typo-pkg"):
        registry = reg.build_registry()
    assert "fancy" in registry.names("probe") and "typo" not in registry.names("probe")
    assert [(e.plugin, e.provider) for e in registry.errors] == [("typo", "typo-pkg")]
    assert "ivyplug_probe" in str(registry.errors[0])


def _manual_registry(*components: object) -> reg.Registry:
    plugin = types.SimpleNamespace()

    @hookimpl
    def ivyplug_optimizers():  # type: ignore[no-untyped-def]
        return [c for c in components if isinstance(c, Optimizer)]

    @hookimpl
    def ivyplug_callbacks():  # type: ignore[no-untyped-def]
        return [c for c in components if isinstance(c, Callback)]

    plugin.ivyplug_optimizers = ivyplug_optimizers
    plugin.ivyplug_callbacks = ivyplug_callbacks
    pm = reg.pluggy.PluginManager("ivyplug")
    pm.add_hookspecs(reg.hookspecs)
    pm.register(plugin, name="manual")
    registry = reg.Registry(pm)
    reg._collect(registry, pm, "manual", "manual-pkg")
    return registry


def test_framework_prefixed_names_and_bare_resolution() -> None:
    registry = _manual_registry(
        Optimizer("lamb", "json:dumps", framework="torch"),
        Optimizer("lamb", "json:loads", framework="keras"),
        Optimizer("sgdx", "json:dumps", framework="torch"),
    )
    assert registry.names("optimizer") == ["keras.lamb", "torch.lamb", "torch.sgdx"]
    assert registry.resolve("optimizer", "SGDX").name == "torch.sgdx"
    assert registry.resolve("optimizer", "torch.lamb").component.target == "json:dumps"
    with pytest.raises(reg.AmbiguousComponentError, match=r"keras\.lamb, torch\.lamb"):
        registry.resolve("optimizer", "lamb")
    with pytest.raises(reg.UnknownComponentError, match=r"available optimizer names: keras\.lamb, torch\.lamb"):
        registry.resolve("optimizer", "adamx")
    with pytest.raises(reg.UnknownComponentError, match=r"torch\.sgdx \(or without the framework's prefix where"):
        registry.resolve("optimizer", "adamx")  # the example is a short name that resolves: sgdx, not lamb
    with pytest.raises(ValueError, match="kind must be one of"):
        registry.names("optimiser")


def test_missing_framework_is_unavailable_with_extra_hint() -> None:
    registry = _manual_registry(
        Callback("ghost", "ghost_framework_mod:Ghost", requires=("ghost_framework_mod",), extra="ghost"),
    )
    entry = registry.resolve("callback", "ghost")
    assert not entry.available
    assert entry.missing == ["ghost_framework_mod"]
    with pytest.raises(reg.ComponentUnavailableError, match=r"pip install 'manual-pkg\[ghost\]'"):
        registry.get("callback", "ghost")
    third = reg.Entry(Callback("ghost", "g:G", requires=("ghost_framework_mod",), extra="gpu"), "ghost-pkg", "g")
    assert third.install_hint() == "needs ghost_framework_mod: pip install 'ghost-pkg[gpu]'"  # its package's extra


def test_component_records_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="target"):
        Strategy("x", "no_colon")
    with pytest.raises(ValueError, match="framework"):
        Probe("x", "a:b", framework="jax")
    with pytest.raises(ValueError, match="name"):
        Probe("", "a:b")


def test_wrong_record_type_is_a_plugin_error(site: Path) -> None:
    body = """
    from ivyplug.components import Probe
    from ivyplug.hookspecs import hookimpl
    @hookimpl
    def ivyplug_strategies():
        return [Probe("p", "json:dumps")]
    """
    _write_dist(site, "wrong-type", "wrong_type_plugin", "wrongtype", body)
    with pytest.warns(RuntimeWarning, match="must yield"):
        registry = reg.build_registry()
    assert registry.errors[0].provider == "wrong-type"


def test_get_registry_is_cached_and_resettable() -> None:
    import ivyplug

    first = ivyplug.get_registry()
    assert ivyplug.get_registry() is first
    reg.reset_registry()
    assert ivyplug.get_registry() is not first
