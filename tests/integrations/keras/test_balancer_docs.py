"""docs/configuration.md lists every option of both IvyLoadBalancer twins, with the defaults the code has."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from ivyplug.integrations.keras import load_balancer as keras_lb
from ivyplug.integrations.lightning import load_balancer as lightning_lb

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _rows() -> dict[str, tuple[bool, bool, list[str]]]:
    """option name -> (Lightning has it, Keras has it, the defaults in the row's default cell)."""
    text = DOC.read_text()
    section = text[text.index("## `IvyLoadBalancer`") :]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, tuple[bool, bool, list[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 5 or not cells[0].startswith("`") or "(" in cells[0]:
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        defaults = re.findall(r"`([^`]*)`", cells[3])
        for i, name in enumerate(names):
            rows[name] = (cells[1] == "✓", cells[2] == "✓", defaults[i : i + 1] if len(defaults) == len(names) else [])
    return rows


def _options(cls: type) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}


def test_every_option_of_both_twins_is_in_the_table_with_its_default() -> None:
    rows = _rows()
    light, keras_ = _options(lightning_lb.IvyLoadBalancer), _options(keras_lb.IvyLoadBalancer)
    for name in set(light) | set(keras_):
        assert name in rows, f"{name} is missing from the IvyLoadBalancer table in docs/configuration.md"
        in_light, in_keras, documented = rows[name]
        assert (in_light, in_keras) == (name in light, name in keras_), name
        default = light.get(name, keras_.get(name))
        if documented and name != "probes":  # probes: the documented default is the probe list setup builds
            assert documented[0] == repr(default).replace("'", '"'), (name, documented, default)
    assert set(rows) <= set(light) | set(keras_), sorted(set(rows) - set(light) - set(keras_))
