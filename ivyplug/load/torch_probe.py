"""Per-step memory signals from torch's CUDA caching allocator, and an out-of-memory counter.

Keys per CUDA-visible device ``i``: ``cuda{i}_allocated``, ``cuda{i}_reserved``, ``cuda{i}_peak``
(max allocated since the previous read when ``reset_peak`` is on), ``cuda{i}_total`` (bytes) and
``cuda{i}_alloc_retries`` (the allocator freed its cache and retried: memory pressure before an OOM).
``oom_count`` is the number of out-of-memory errors reported through :meth:`record_oom`.

On a machine without CUDA (this includes CPU-only torch builds) the allocator has nothing to say:
``available()`` is False and ``read()`` returns only ``{"oom_count": n}``. torch is imported on first
use, never at import time, and only when it is installed.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

from ivyplug.load.probe import Readings


class TorchAllocatorProbe:
    """CUDA allocator counters (reserved, peak, retries) plus an OOM counter fed by the trainer."""

    name = "torch_allocator"

    def __init__(self, reset_peak: bool = True) -> None:
        """``reset_peak``: reset the peak counter after each read, so ``peak`` is per read interval."""
        self.reset_peak = reset_peak
        self._oom_count = 0
        self._lock = threading.Lock()

    @property
    def oom_count(self) -> int:
        return self._oom_count

    def record_oom(self) -> None:
        """Count one out-of-memory error (called by the code that caught it)."""
        with self._lock:
            self._oom_count += 1

    def _torch(self) -> Any | None:
        if "torch" in sys.modules:
            return sys.modules["torch"]
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        return torch

    def available(self) -> bool:
        torch = self._torch()
        return bool(torch is not None and torch.cuda.is_available())

    @property
    def unavailable_reason(self) -> str | None:
        """Why there are no allocator readings (``None`` when CUDA is available)."""
        torch = self._torch()
        if torch is None:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return f"no CUDA device (torch {torch.__version__}): only the OOM count is reported"
        return None

    def read(self) -> Readings:
        out: Readings = {"oom_count": float(self._oom_count)}
        torch = self._torch()
        if torch is None or not torch.cuda.is_available():
            return out
        for i in range(torch.cuda.device_count()):
            stats = torch.cuda.memory_stats(i)
            out[f"cuda{i}_allocated"] = float(stats.get("allocated_bytes.all.current", 0))
            out[f"cuda{i}_reserved"] = float(stats.get("reserved_bytes.all.current", 0))
            out[f"cuda{i}_peak"] = float(stats.get("allocated_bytes.all.peak", 0))
            out[f"cuda{i}_alloc_retries"] = float(stats.get("num_alloc_retries", 0))
            out[f"cuda{i}_total"] = float(torch.cuda.get_device_properties(i).total_memory)
            if self.reset_peak:
                torch.cuda.reset_peak_memory_stats(i)
        return out

    def close(self) -> None:
        """Nothing to release: the allocator belongs to torch."""
