"""Project defaults: ``[tool.ivyplug.<section>]`` in the nearest ``pyproject.toml``, then ``IVYPLUG_*`` variables.

An existing project switches ivyplug's behaviour from configuration, without editing training code: with

    [tool.ivyplug.ps]
    timeout = 300.0
    num_servers = 2

in its ``pyproject.toml``, ``Trainer(strategy="ivy_ps")`` runs with those values. Precedence, highest first:
an argument passed in code, the environment variable (``IVYPLUG_PS_TIMEOUT=300``), the ``pyproject.toml``
value, the built-in default. The file is the first ``pyproject.toml`` found from the working directory
upwards. Unknown keys (and sections, and ``IVYPLUG_PS_*`` variables) and values of the wrong type raise
``ValueError`` naming the key, where it was set and what is allowed: a misspelt name is never ignored.
Framework-free (``tomllib``, or ``tomli`` on Python 3.10).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, as a package (a dependency on 3.10)
    import tomli as tomllib


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("an integer")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("a number")
    return float(value)


#: How a switch may be spelt in an environment variable (any case), as ivyplug's other switches
#: (``IVYPLUG_DISABLE_*``) are; a project file takes TOML's true and false.
_ENV_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("true or false (in an environment variable also 1/0, yes/no, on/off, in any case)")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


#: section -> key -> parser of the value (raises TypeError naming what is allowed). Environment values are
#: strings; they are read as TOML scalars first (``300``, ``300.0``, ``"auto"``) so both sources parse alike.
SECTIONS: dict[str, dict[str, Callable[[Any], Any]]] = {
    # IvyPSStrategy's arguments whose None means "the project default, else the built-in one"
    "ps": {
        "timeout": _float,
        "num_servers": _int,
        "staleness_scaling": _str,
        "nonfinite": _str,
        "servers": _str,
        "wire_dtype": _str,
        "shared_memory": _bool,
    },
}

#: the shared secret of an ``ivyplug serve`` comes from code or this variable only (never a project file)
TOKEN_ENV = "IVYPLUG_TOKEN"


def token(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """``explicit``, else ``$IVYPLUG_TOKEN``, else None."""
    if explicit is not None:
        return explicit
    environ = os.environ if environ is None else environ
    return environ.get(TOKEN_ENV) or None


def find_pyproject(start: Path | None = None) -> Path | None:
    """The first ``pyproject.toml`` in ``start`` (default: the working directory) or a parent of it."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def _env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word such as none / inverse: a string


def project_defaults(
    section: str, start: Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The configured values of ``section`` (only keys that are set), environment over ``pyproject.toml``."""
    return {key: value for key, (value, _) in project_settings(section, start, environ).items()}


#: the address a job's dedicated servers listen on (read by them, not a project default)
PS_HOST_ENV = "IVYPLUG_PS_HOST"
#: ``IVYPLUG_PS_*`` variables that are not project defaults of the ``ps`` section (read where they are used)
OTHER_VARIABLES = {PS_HOST_ENV}


def project_settings(
    section: str, start: Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, tuple[Any, str]]:
    """As :func:`project_defaults`, each value with where it was set (``"<file>: [tool.ivyplug.ps] timeout"``,
    ``"environment variable IVYPLUG_PS_TIMEOUT"``), so that a value refused later can name its source."""
    if section not in SECTIONS:
        raise ValueError(f"unknown ivyplug settings section {section!r}; known: {sorted(SECTIONS)}")
    parsers = SECTIONS[section]
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    path = find_pyproject(start)
    if path is not None:
        table = _section_table(path, section, parsers)
        for key, value in table.items():
            values[key], origin[key] = value, f"{path}: [tool.ivyplug.{section}] {key}"
    prefix = f"IVYPLUG_{section.upper()}_"
    names = {f"{prefix}{key.upper()}": key for key in parsers}
    unknown = sorted(n for n in environ if n.startswith(prefix) and n not in names and n not in OTHER_VARIABLES)
    if unknown:
        raise ValueError(f"unknown environment variable(s) {unknown}; allowed: {sorted(names)}")
    for name, key in names.items():
        if name in environ:
            raw = environ[name]
            value = _ENV_BOOLS.get(raw.strip().lower(), raw) if parsers[key] is _bool else _env_value(raw)
            values[key], origin[key] = value, f"environment variable {name}"
    out: dict[str, tuple[Any, str]] = {}
    for key, value in values.items():
        try:
            out[key] = (parsers[key](value), origin[key])
        except TypeError as exc:
            raise ValueError(f"{origin[key]} must be {exc}, got {value!r}") from None
    return out


def _section_table(path: Path, section: str, parsers: Mapping[str, Any]) -> dict[str, Any]:
    """``[tool.ivyplug.<section>]`` of ``path``, every name under ``[tool.ivyplug]`` checked."""
    try:
        with path.open("rb") as f:
            document = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc}); ivyplug reads its [tool.ivyplug] tables") from None
    tool = document.get("tool", {})
    ours = tool.get("ivyplug", {}) if isinstance(tool, dict) else None  # `tool = "x"`: not a table either
    if not isinstance(ours, dict):
        raise ValueError(f"{path}: [tool.ivyplug] must be a table of sections; allowed: {sorted(SECTIONS)}")
    unknown = sorted(set(ours) - set(SECTIONS))
    if unknown:
        raise ValueError(
            f"{path}: unknown name(s) {unknown} in [tool.ivyplug]; allowed sections: "
            + ", ".join(f"[tool.ivyplug.{name}]" for name in sorted(SECTIONS))
        )
    table = ours.get(section, {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [tool.ivyplug.{section}] must be a table")
    unknown = sorted(set(table) - set(parsers))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} in [tool.ivyplug.{section}]; allowed: {sorted(parsers)}")
    return dict(table)
