"""The few collectives among a job's workers (start, sync, epoch start, checkpoints, close).

They run on a gloo group of their own, so they never interleave with the point-to-point PS traffic, and
every one of them is bounded by the PS ``timeout`` with an error naming what it waited for.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.wire import gloo_net
from ivyplug.ps.wire.transport import wait_work


class WorkerGroup:
    """Collectives among ``world_size`` workers (no communication at all with one worker)."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.group: Any = None
        if world_size > 1:
            with gloo_net.interface_for(os.environ.get("MASTER_ADDR")):
                self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def wait(self, work: Any, what: str) -> None:
        wait_work(work, self.timeout, f"{what} (collective on the PS group, rank {self.rank})")

    def barrier(self, what: str) -> None:
        if self.world_size > 1:
            self.wait(dist.barrier(group=self.group, async_op=True), what)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Rank 0's ``tensor`` to every worker, in place."""
        if self.world_size > 1:
            self.wait(dist.broadcast(tensor, src=0, group=self.group, async_op=True), what)

    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        if self.world_size == 1:
            return [tensor]
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        self.wait(dist.all_gather(parts, tensor, group=self.group, async_op=True), what)
        return parts

    def link_rate(self, nbytes: int, tries: int = 3) -> float:
        """Bytes per second of an all-reduce of ``nbytes`` among the workers: the slowest rank's time of each try,
        the best try (after one that opens the connections; on a fast link a busy machine's hiccups come and go);
        the same number on every rank."""
        data = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        times = []
        for _ in range(tries + 1):
            t0 = time.perf_counter()
            self.wait(dist.all_reduce(data, group=self.group, async_op=True), "the link's timing")
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times[1:], dtype=torch.float64)
        self.wait(dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group, async_op=True), "the link's timing")
        return 4 * data.numel() / max(float(slowest.min()), 1e-9)

    def _padded(self, blob: bytes, what: str) -> tuple[list[int], torch.Tensor]:
        """Every worker's length of its ``blob`` (all-gathered) and this worker's, zero-padded to the longest."""
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
        sizes = [int(x) for x in self.all_gather(torch.tensor([mine.numel()], dtype=torch.int64), f"{what} (sizes)")]
        padded = torch.zeros(max(1, *sizes), dtype=torch.uint8)
        padded[: mine.numel()] = mine
        return sizes, padded

    def share_all(self, blob: bytes) -> list[bytes]:
        """All-gather one byte string per worker."""
        if self.world_size == 1:
            return [blob]
        sizes, padded = self._padded(blob, "checkpoint shards")
        parts = self.all_gather(padded, "checkpoint shards")
        return [parts[r][: sizes[r]].numpy().tobytes() for r in range(self.world_size)]

    def gather_to_rank0(self, blob: bytes, what: str) -> dict[int, bytes] | None:
        """Every worker's ``blob`` on rank 0, by rank; ``None`` on the others, which receive nothing (a checkpoint's
        per-worker parts: only rank 0 writes them, and N of them on every rank would be N times the memory)."""
        if self.world_size == 1:
            return {0: blob}
        sizes, padded = self._padded(blob, what)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        self.wait(dist.gather(padded, parts, dst=0, group=self.group, async_op=True), what)
        if parts is None:
            return None
        return {r: parts[r][: sizes[r]].numpy().tobytes() for r in range(self.world_size)}

    def share_from_rank0(self, blobs: list[bytes], count: int) -> list[bytes]:
        """Rank 0's ``count`` byte strings to every worker."""
        if self.world_size == 1:
            return blobs
        sizes = torch.tensor([len(b) for b in blobs] if self.rank == 0 else [0] * count, dtype=torch.int64)
        self.broadcast(sizes, "checkpoint sizes")
        data = torch.zeros(max(1, int(sizes.sum())), dtype=torch.uint8)
        if self.rank == 0 and int(sizes.sum()):
            data[: int(sizes.sum())] = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        self.broadcast(data, "checkpoint shards")
        raw = data.numpy().tobytes()
        out, start = [], 0
        for n in sizes.tolist():
            out.append(raw[start : start + n])
            start += n
        return out

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
