from __future__ import annotations

import subprocess
import sys

import pytest

from ivyplug.ps import PSConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "bsp"}, "PSConfig.mode"),
        ({"mode": "ssp"}, "PSConfig.staleness"),
        ({"mode": "ssp", "staleness": -1}, "PSConfig.staleness"),
        ({"mode": "ssp", "staleness": 1.5}, "PSConfig.staleness"),
        ({"mode": "async", "staleness": 2}, "PSConfig.staleness"),
        ({"staleness_scaling": "sqrt"}, "PSConfig.staleness_scaling"),
        ({"timeout": 0}, "PSConfig.timeout"),
        ({"timeout": float("inf")}, "PSConfig.timeout"),
        ({"timeout": True}, "PSConfig.timeout"),
        ({"num_servers": -1}, "PSConfig.num_servers"),
        ({"max_shard_bytes": 0}, "PSConfig.max_shard_bytes"),
        ({"overlap_backward": "yes"}, "PSConfig.overlap_backward"),
        ({"overlap_backward": 1}, "PSConfig.overlap_backward"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PSConfig(**kwargs)


def test_unknown_field_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown PSConfig field\(s\) \['stalenes'\].*staleness"):
        PSConfig.from_kwargs(mode="ssp", stalenes=2)


def test_good_configs() -> None:
    assert PSConfig().mode == "async"
    cfg = PSConfig.from_kwargs(mode="ssp", staleness=0, timeout=5)
    assert cfg.to_dict()["staleness"] == 0


def test_config_import_is_torch_free() -> None:
    code = "import sys, ivyplug.ps; ivyplug.ps.PSConfig(mode='sync'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
