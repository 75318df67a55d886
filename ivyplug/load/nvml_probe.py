"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py): utilisation, memory, temperature, power.

Keys use the *CUDA-visible* index ``i`` (the index torch and ``Trainer(devices=[i])`` use):
``gpu{i}_util`` and ``gpu{i}_mem_util`` (percent), ``gpu{i}_mem_used`` / ``_mem_free`` / ``_mem_total``
(bytes), ``gpu{i}_temp`` (°C), ``gpu{i}_power`` (W). NVML enumerates every GPU of the machine and
ignores ``CUDA_VISIBLE_DEVICES``, so visible devices are mapped to NVML handles by UUID (``GPU-...``
entries, prefixes allowed, as CUDA does) or by NVML index for integer entries (which matches CUDA's
order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``). Like CUDA, the list stops at the first invalid entry.

Without the library or a driver, ``nvmlInit`` raises; the probe then reports itself unavailable and
logs the reason once at debug level (no warning per read). A field the GPU does not support
(``NVMLError_NotSupported``) is left out of the readings and not asked for again.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Any

from ivyplug.load.probe import Readings

log = logging.getLogger(__name__)

#: Reading suffix -> how to get it from one handle (pynvml module, handle) -> float.
_FIELDS: dict[str, Any] = {
    "util": lambda nv, h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
    "mem_util": lambda nv, h: float(nv.nvmlDeviceGetUtilizationRates(h).memory),
    "temp": lambda nv, h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    "power": lambda nv, h: float(nv.nvmlDeviceGetPowerUsage(h)) / 1000.0,
}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Entries of ``CUDA_VISIBLE_DEVICES``; ``None`` when unset (all devices visible)."""
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


class NvmlProbe:
    """Per-GPU load from NVML; unavailable (not an error) without a driver or the pynvml module."""

    name = "nvml"

    def __init__(self, pynvml_module: ModuleType | None = None, visible_devices: str | None = None) -> None:
        """``pynvml_module`` replaces ``import pynvml`` (tests); ``visible_devices`` replaces the environment."""
        self._module = pynvml_module
        self._visible_override = visible_devices
        self._lock = threading.Lock()
        self._handles: list[Any] | None = None
        self._unsupported: set[tuple[int, str]] = set()
        self._error: str | None = None

    @property
    def unavailable_reason(self) -> str | None:
        """Why the probe is unavailable (``None`` when available or not tried yet)."""
        return self._error

    def _nv(self) -> ModuleType:
        if self._module is None:
            import pynvml

            self._module = pynvml
        return self._module

    def _open(self) -> list[Any] | None:
        """Initialise NVML once and map the visible devices; remember a failure instead of retrying."""
        if self._handles is not None or self._error is not None:
            return self._handles
        try:
            nv = self._nv()
        except ImportError as exc:
            self._error = f"pynvml is not installed ({exc}); pip install 'ivyplug[gpu]'"
            log.debug("nvml probe unavailable: %s", self._error)
            return None
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            self._error = f"NVML could not start: {type(exc).__name__}: {exc}"
            log.debug("nvml probe unavailable: %s", self._error)
            return None
        try:
            self._handles = self._map_visible(nv)
        except nv.NVMLError as exc:
            self._error = f"NVML could not list devices: {type(exc).__name__}: {exc}"
            log.debug("nvml probe unavailable: %s", self._error)
            self._shutdown(nv)
            return None
        return self._handles

    def _map_visible(self, nv: ModuleType) -> list[Any]:
        count = int(nv.nvmlDeviceGetCount())
        all_handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        env = self._visible_override if self._visible_override is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = parse_visible_devices(env)
        if entries is None:
            return all_handles
        uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in all_handles]
        handles: list[Any] = []
        for entry in entries:
            if entry.lstrip("-").isdigit():
                index = int(entry)
                if not 0 <= index < count:
                    break  # CUDA ignores this entry and everything after it
                handles.append(all_handles[index])
                continue
            matches = [h for h, u in zip(all_handles, uuids, strict=True) if u.startswith(entry)]
            if len(matches) != 1:
                break  # unknown or ambiguous UUID prefix: CUDA stops here too
            handles.append(matches[0])
        return handles

    def _shutdown(self, nv: ModuleType) -> None:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def available(self) -> bool:
        with self._lock:
            return bool(self._open())

    def device_count(self) -> int:
        """Number of CUDA-visible GPUs NVML can see (0 when unavailable)."""
        with self._lock:
            return len(self._open() or [])

    def read(self) -> Readings:
        with self._lock:
            handles = self._open()
            if not handles:
                return {}
            nv = self._nv()
            out: Readings = {}
            for i, handle in enumerate(handles):
                self._read_memory(nv, i, handle, out)
                for field, getter in _FIELDS.items():
                    if (i, field) in self._unsupported:
                        continue
                    try:
                        out[f"gpu{i}_{field}"] = getter(nv, handle)
                    except nv.NVMLError_NotSupported:
                        self._unsupported.add((i, field))
                    except nv.NVMLError as exc:
                        log.debug("nvml: gpu%d %s failed: %s", i, field, exc)
            return out

    def _read_memory(self, nv: ModuleType, i: int, handle: Any, out: Readings) -> None:
        if (i, "mem") in self._unsupported:
            return
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
        except nv.NVMLError_NotSupported:
            self._unsupported.add((i, "mem"))
            return
        except nv.NVMLError as exc:
            log.debug("nvml: gpu%d memory failed: %s", i, exc)
            return
        out[f"gpu{i}_mem_used"] = float(mem.used)
        out[f"gpu{i}_mem_free"] = float(mem.free)
        out[f"gpu{i}_mem_total"] = float(mem.total)

    def close(self) -> None:
        with self._lock:
            if self._handles is not None and self._module is not None:
                self._shutdown(self._module)
            self._handles = None
            self._error = None
            self._unsupported.clear()
