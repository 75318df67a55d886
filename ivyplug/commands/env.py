"""``ivyplug env``: what a bug report needs: versions, start-up hooks, NVML, and the project defaults in effect.

Versions come from package metadata (no framework is imported to learn them). A start-up hook is *active* when its
``.pth`` file ran in this interpreter (site-packages holds it and its ``IVYPLUG_DISABLE_*`` switch is off).
Project defaults are those of :mod:`ivyplug.settings`, each with where it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

NAME = "env"
HELP = "show versions, start-up hooks, NVML status and the project defaults in effect (for bug reports)"

#: Reported packages -> the distributions that provide them (the first one installed is reported).
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "lightning": ("lightning",),
    "keras": ("keras",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly"),
}

#: Framework -> (``.pth`` file name in site-packages, module the hook loads, switch-off variable).
HOOKS: dict[str, tuple[str, str, str]] = {
    "lightning": (
        "ivyplug_lightning_autoregister.pth",
        "ivyplug.integrations.lightning.autoregister",
        "IVYPLUG_DISABLE_LIGHTNING_AUTOREGISTER",
    ),
    "keras": (
        "ivyplug_keras_autoregister.pth",
        "ivyplug.integrations.keras.autoregister",
        "IVYPLUG_DISABLE_KERAS_AUTOREGISTER",
    ),
}

NOT_INSTALLED = "not installed"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def package_versions() -> dict[str, str | None]:
    """Installed version of each of :data:`PACKAGES` (``None``: not installed), read from metadata."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name, dists in PACKAGES.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _site_dirs() -> list[Path]:
    import site

    dirs = list(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dict.fromkeys(dirs)]


def _switched_off(variable: str) -> bool:
    """The test the ``.pth`` line itself makes."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


def startup_hooks() -> dict[str, dict[str, Any]]:
    """Per framework: the ``.pth`` file found (or ``None``), whether it is switched off, whether it is active."""
    site_dirs = _site_dirs()
    out: dict[str, dict[str, Any]] = {}
    for framework, (pth, module, variable) in HOOKS.items():
        found = next((d / pth for d in site_dirs if (d / pth).is_file()), None)
        disabled = _switched_off(variable)
        # the .pth line imports the hook module only when its switch is not set and ivyplug is importable
        active = found is not None and not disabled and module in sys.modules
        if found is None:
            detail = f"not installed ({pth} is not in site-packages: reinstall ivyplug with pip)"
        elif disabled:
            detail = f"switched off by {variable}"
        elif active:
            detail = f"active ({found})"
        else:
            # the .pth skips itself when ivyplug was not importable at start-up; python -S / -I skip every .pth
            detail = f"installed but did not run in this interpreter ({found})"
        pth_path = None if found is None else str(found)
        out[framework] = {"pth": pth_path, "disabled": disabled, "active": active, "detail": detail}
    return out


def nvml_status() -> dict[str, Any]:
    """NVML availability and device count (the ``nvml`` probe's view, CUDA_VISIBLE_DEVICES applied)."""
    from ivyplug.load.nvml_probe import NvmlProbe

    probe = NvmlProbe()
    try:
        available = probe.available()
        return {
            "available": available,
            "devices": probe.device_count() if available else 0,
            "reason": None if available else probe.unavailable_reason,
        }
    finally:
        probe.close()


def project_settings(start: Path | None = None) -> dict[str, Any]:
    """Every settings key per section: the value in effect (a built-in default's too) and its source; the error that
    stops the section loading, or that refuses a value it holds (the check ``IvyPSStrategy()`` makes, in
    ``PSConfig``'s words). The pyproject.toml is the one found from ``start`` (default: the working directory)."""
    from dataclasses import fields

    from ivyplug import settings
    from ivyplug.ps.config import PSConfig, naming_sources

    builtin = {"ps": {f.name: f.default for f in fields(PSConfig)}}

    path = settings.find_pyproject(start)
    sections: dict[str, Any] = {}
    for section, parsers in settings.SECTIONS.items():
        try:
            values = settings.project_settings(section, start)
        except ValueError as exc:
            sections[section] = {"error": str(exc)}
            continue
        keys: dict[str, Any] = {}
        for key in parsers:
            value, source = values.get(key, (builtin.get(section, {}).get(key), "built-in default"))
            keys[key] = {"value": value, "source": source}
        sections[section] = {"keys": keys}
        if section == "ps":
            try:  # each value parses; together they must also make a configuration
                PSConfig.from_kwargs(**{key: value for key, (value, _) in values.items()})
            except ValueError as exc:
                sources = {key: source for key, (_, source) in values.items()}
                sections[section]["error"] = naming_sources(str(exc), sources)
    return {"pyproject": None if path is None else str(path), "sections": sections}


def collect() -> dict[str, Any]:
    """Everything ``ivyplug env`` reports, as plain JSON values."""
    import platform

    import ivyplug
    from ivyplug._version import __version__

    return {
        "ivyplug": {"version": __version__, "location": str(Path(ivyplug.__file__).parent)},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": package_versions(),
        "startup_hooks": startup_hooks(),
        "nvml": nvml_status(),
        "settings": project_settings(),
    }


def _print_text(info: dict[str, Any]) -> None:
    me, py = info["ivyplug"], info["python"]
    print(f"ivyplug {me['version']} ({me['location']})")
    print(f"python  {py['version']} ({py['executable']})")
    print("packages:")
    for name, version in info["packages"].items():
        print(f"  {name:<12} {version or NOT_INSTALLED}")
    print("start-up hooks:")
    for name, hook in info["startup_hooks"].items():
        print(f"  {name:<12} {hook['detail']}")
    nvml = info["nvml"]
    if nvml["available"]:
        print(f"NVML: available, {nvml['devices']} device(s)")
    else:
        print(f"NVML: unavailable ({nvml['reason']})")
    settings = info["settings"]
    print(f"project defaults (pyproject.toml: {settings['pyproject'] or 'none found'}):")
    for section, content in settings["sections"].items():
        if "error" in content:
            print(f"  [{section}] error: {content['error']}")
        for key, entry in content.get("keys", {}).items():
            shown = "-" if entry["value"] is None else json.dumps(entry["value"])
            print(f"  {section}.{key:<20} {shown:<10} {entry['source']}")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_text(info)
    # a settings table that does not load would stop training too: say so in the exit status
    return 1 if any("error" in s for s in info["settings"]["sections"].values()) else 0
