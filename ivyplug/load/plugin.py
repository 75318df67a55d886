"""Registry plugin: ivyplug's built-in load probes (strings only; importing this loads nothing)."""

from __future__ import annotations

from collections.abc import Iterator

from ivyplug.components import Probe
from ivyplug.hookspecs import hookimpl


@hookimpl
def ivyplug_probes() -> Iterator[Probe]:
    yield Probe(
        "nvml",
        "ivyplug.load.nvml_probe:NvmlProbe",
        description="NVIDIA GPU utilisation, memory, temperature, power (NVML)",
        requires=("pynvml",),
        extra="gpu",
    )
    yield Probe(
        "torch_allocator",
        "ivyplug.load.torch_probe:TorchAllocatorProbe",
        framework="torch",
        description="CUDA allocator reserved/peak bytes, alloc retries, OOM count",
    )
    yield Probe("psutil", "ivyplug.load.psutil_probe:PsutilProbe", description="host CPU and memory (psutil)")
