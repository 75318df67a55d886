"""NVML probe: real pynvml without a driver, and a fake pynvml for the mapping and readings."""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import pynvml
import pytest

from ivyplug.load import NvmlProbe, least_loaded
from ivyplug.load.device_choice import NoDeviceAvailableError


def test_real_pynvml_without_library_is_unavailable_quietly(caplog: pytest.LogCaptureFixture) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - a machine with a driver
        pynvml.nvmlShutdown()
        pytest.skip("an NVML library is present here")
    probe = NvmlProbe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("WARNING"):
            for _ in range(50):
                assert probe.available() is False
                assert probe.read() == {}
    assert caplog.records == []
    assert probe.unavailable_reason is not None and "NVMLError_LibraryNotFound" in probe.unavailable_reason
    probe.close()
    with pytest.raises(NoDeviceAvailableError, match="NVML"):
        least_loaded(1)


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Mem:
    used: int
    free: int
    total: int


def fake_pynvml(gpus: list[dict], unsupported: set[tuple[int, str]] = frozenset(), init_error: str | None = None):
    """A stand-in module with pynvml's names; ``gpus[i]`` describes NVML device i."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    m = types.ModuleType("fake_pynvml")
    m.NVMLError = NVMLError
    m.NVMLError_NotSupported = NVMLError_NotSupported
    m.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    m.NVML_TEMPERATURE_GPU = 0
    m.calls = {"util": 0, "temp": 0, "power": 0, "mem": 0, "init": 0, "shutdown": 0}

    def init() -> None:
        m.calls["init"] += 1
        if init_error == "driver":
            raise NVMLError_DriverNotLoaded("Driver Not Loaded")

    def check(i: int, field: str) -> None:
        m.calls[field] += 1
        if (i, field) in unsupported:
            raise NVMLError_NotSupported("Not Supported")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.__setitem__("shutdown", m.calls["shutdown"] + 1)
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: gpus[h]["uuid"].encode()  # older pynvml returns bytes

    def util(h: int) -> _Util:
        check(h, "util")
        return _Util(gpus[h]["util"], gpus[h]["mem_util"])

    def temp(h: int, sensor: int) -> int:
        assert sensor == 0
        check(h, "temp")
        return gpus[h]["temp"]

    def power(h: int) -> int:
        check(h, "power")
        return gpus[h]["power_mw"]

    def mem(h: int) -> _Mem:
        check(h, "mem")
        return _Mem(gpus[h]["used"], gpus[h]["total"] - gpus[h]["used"], gpus[h]["total"])

    m.nvmlDeviceGetUtilizationRates = util
    m.nvmlDeviceGetTemperature = temp
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetMemoryInfo = mem
    return m


GIB = 2**30


def _gpu(uuid: str, util: int, mem_util: int, temp: int, power_mw: int, used_gib: int) -> dict:
    return {
        "uuid": uuid,
        "util": util,
        "mem_util": mem_util,
        "temp": temp,
        "power_mw": power_mw,
        "used": used_gib * GIB,
        "total": 40 * GIB,
    }


GPUS = [
    _gpu("GPU-aaaa-0000", 90, 40, 70, 250_000, 30),
    _gpu("GPU-bbbb-1111", 5, 1, 40, 60_500, 2),
    _gpu("GPU-cccc-2222", 20, 10, 50, 100_000, 1),
]


def test_readings_of_all_devices_without_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = NvmlProbe(pynvml_module=fake_pynvml(GPUS))
    assert probe.available() and probe.device_count() == 3
    r = probe.read()
    assert r["gpu0_util"] == 90.0 and r["gpu0_mem_util"] == 40.0
    assert r["gpu1_temp"] == 40.0 and r["gpu1_power"] == pytest.approx(60.5)
    assert r["gpu2_mem_used"] == 1 * GIB and r["gpu2_mem_total"] == 40 * GIB and r["gpu2_mem_free"] == 39 * GIB


def test_cuda_visible_devices_mapped_by_uuid_and_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc,GPU-aaaa-0000")
    r = NvmlProbe(pynvml_module=fake_pynvml(GPUS)).read()
    # visible index 0 is NVML device 2 (UUID prefix), visible 1 is NVML device 0
    assert r["gpu0_util"] == 20.0 and r["gpu1_util"] == 90.0
    assert not any(k.startswith("gpu2_") for k in r)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-zzzz,0")  # CUDA stops at the first invalid entry
    r = NvmlProbe(pynvml_module=fake_pynvml(GPUS)).read()
    assert r["gpu0_util"] == 5.0 and not any(k.startswith("gpu1_") for k in r)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlProbe(pynvml_module=fake_pynvml(GPUS)).available() is False


def test_not_supported_fields_are_left_out_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = fake_pynvml(GPUS, unsupported={(1, "power"), (0, "temp"), (2, "mem")})
    probe = NvmlProbe(pynvml_module=fake)
    for _ in range(3):
        r = probe.read()
        assert "gpu1_power" not in r and "gpu0_temp" not in r and "gpu2_mem_used" not in r
        assert r["gpu0_power"] == 250.0 and r["gpu1_temp"] == 40.0 and r["gpu2_util"] == 20.0
    assert fake.calls["power"] == 3 + 1 + 3  # gpu1 asked once, gpus 0 and 2 three times each
    probe.close()
    assert fake.calls["shutdown"] == 1


def test_driver_not_loaded_is_unavailable_and_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml(GPUS, init_error="driver")
    probe = NvmlProbe(pynvml_module=fake)
    for _ in range(10):
        assert probe.read() == {}
    assert fake.calls["init"] == 1
    assert "DriverNotLoaded" in (probe.unavailable_reason or "")


def test_least_loaded_ranks_by_utilisation_with_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = NvmlProbe(pynvml_module=fake_pynvml(GPUS))
    assert least_loaded(2, probe=probe) == [1, 2]
    assert least_loaded(3, probe=probe) == [1, 2, 0]
    assert least_loaded(1, min_free_memory="38.5GiB", probe=probe) == [2]
    assert least_loaded(2, max_utilization=50, probe=probe) == [1, 2]
    with pytest.raises(NoDeviceAvailableError, match=r"gpu0: 90% busy"):
        least_loaded(3, max_utilization=50, probe=probe)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        least_loaded(0, probe=probe)
    with pytest.raises(ValueError, match="min_free_memory"):
        least_loaded(1, min_free_memory="lots", probe=probe)
    with pytest.raises(ValueError, match="max_utilization"):
        least_loaded(1, max_utilization=120, probe=probe)


def test_real_driver_readings() -> None:
    """On a machine with an NVIDIA driver: every visible GPU is read, with plausible values."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVML driver here (the fake-pynvml tests above cover the mapping and readings)")
    pynvml.nvmlShutdown()
    probe = NvmlProbe()
    try:
        n = probe.device_count()
        if n == 0:
            pytest.skip("NVML sees no GPU this process may use (CUDA_VISIBLE_DEVICES)")
        assert probe.available()
        readings = probe.read()
        for i in range(n):
            total, used = readings[f"gpu{i}_mem_total"], readings[f"gpu{i}_mem_used"]
            assert 0 <= used <= total and total > 0
            assert readings[f"gpu{i}_mem_free"] <= total
            if f"gpu{i}_util" in readings:
                assert 0 <= readings[f"gpu{i}_util"] <= 100
    finally:
        probe.close()
