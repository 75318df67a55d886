"""torch allocator, psutil and scripted probes; the registry plugin; ivyplug.least_loaded."""

from __future__ import annotations

import pytest

import ivyplug
from ivyplug.load import Probe, PsutilProbe, ScriptedProbe, TorchAllocatorProbe, default_probes
from ivyplug.load.device_choice import least_loaded
from ivyplug.load.probes import make_probe, probe_config


def test_torch_allocator_probe_on_cpu_reports_only_the_oom_count() -> None:
    import torch

    probe = TorchAllocatorProbe()
    assert isinstance(probe, Probe)
    assert probe.available() is torch.cuda.is_available()
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert "cuda0_peak" in probe.read()
    else:
        assert probe.read() == {"oom_count": 0.0}
    probe.record_oom()
    probe.record_oom()
    assert probe.read()["oom_count"] == 2.0 and probe.oom_count == 2


def test_psutil_probe_reads_cpu_and_memory() -> None:
    probe = PsutilProbe()
    assert probe.available()
    r = probe.read()
    assert 0.0 <= r["cpu_util"] <= 100.0
    assert 0 < r["mem_used"] <= r["mem_total"] and 0 < r["mem_available"] <= r["mem_total"]
    assert "cpu0_util" in r
    assert "cpu0_util" not in PsutilProbe(per_cpu=False).read()


def test_scripted_probe_replays_holds_loops_and_follows_a_clock() -> None:
    trace = [{"gpu0_util": 10}, {"gpu0_util": 20.5}, {"gpu0_util": 30}]
    p = ScriptedProbe(trace)
    assert [p.read()["gpu0_util"] for _ in range(5)] == [10.0, 20.5, 30.0, 30.0, 30.0]
    p.close()
    assert p.read() == {"gpu0_util": 10.0}
    looped = ScriptedProbe(trace, loop=True)
    assert [looped.read()["gpu0_util"] for _ in range(4)] == [10.0, 20.5, 30.0, 10.0]
    epoch = [0]
    clocked = ScriptedProbe(trace, clock=lambda: epoch[0])
    assert clocked.read() == clocked.read() == {"gpu0_util": 10.0}
    epoch[0] = 7
    assert clocked.read() == {"gpu0_util": 30.0}
    epoch[0] = -1
    with pytest.raises(ValueError, match="non-negative"):
        clocked.read()
    for bad in ([], {"a": 1.0}, [{"a": "x"}], [{"a": float("nan")}], [3]):
        with pytest.raises(ValueError, match="trace"):
            ScriptedProbe(bad)  # type: ignore[arg-type]


def test_registry_provides_the_probes() -> None:
    registry = ivyplug.get_registry()
    names = registry.names("probe")
    for name in ("nvml", "psutil"):
        assert name in names
    assert "scripted" not in names  # a test and demo tool, not a built-in component
    assert registry.resolve("probe", "torch_allocator").name == "torch.torch_allocator"
    scripted = make_probe({"name": "scripted", "trace": [{"util": 1.0}], "loop": True})
    assert isinstance(scripted, ScriptedProbe) and scripted.loop
    assert probe_config(scripted) == {"name": "scripted", "trace": [{"util": 1.0}], "loop": True}
    kinds = {type(p).__name__ for p in default_probes()}
    assert {"NvmlProbe", "TorchAllocatorProbe", "PsutilProbe"} <= kinds


def test_least_loaded_is_a_lazy_top_level_attribute() -> None:
    assert ivyplug.least_loaded is least_loaded
    assert "least_loaded" in dir(ivyplug)
