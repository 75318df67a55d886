"""Which sample indices every worker takes at every step of one epoch, given the global batch and shares.

An epoch over N samples with global batch B has S = ceil(N/B) steps (floor with ``drop_last``).
Without ``drop_last`` the N samples are spread as evenly as possible over the S steps (sizes differ
by at most one, each at most B), so that no step is tiny; each step is split across workers in
proportion to the shares. Every worker runs the same number of steps, no batch is empty, and every
sample is used exactly once. The plan is a pure function of its inputs, so every rank computes the
same plan without talking to the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ivyplug.load.shares import worker_shares


@dataclass(frozen=True)
class EpochPlan:
    """Step sizes and per-worker index lists for one epoch."""

    step_sizes: list[int]
    batches: list[list[list[int]]]  # batches[worker][step] -> sample indices

    @property
    def steps(self) -> int:
        return len(self.step_sizes)

    def for_worker(self, worker: int) -> list[list[int]]:
        return self.batches[worker]

    def weight(self, worker: int, step: int) -> float:
        """This worker's share of the step's samples: the gradient weight b_i/B for that step."""
        return len(self.batches[worker][step]) / self.step_sizes[step]


def step_sizes(num_samples: int, batch_size: int, drop_last: bool = False) -> list[int]:
    """Global step sizes for one epoch (see the module docstring)."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last:
        return [batch_size] * (num_samples // batch_size)
    steps = math.ceil(num_samples / batch_size)
    if steps == 0:
        return []
    base, extra = divmod(num_samples, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def plan_epoch(order: Sequence[int], batch_size: int, shares: Sequence[int], drop_last: bool = False) -> EpochPlan:
    """Split ``order`` (this epoch's permutation of sample indices) into per-worker batches."""
    if len(shares) == 0 or sum(shares) != batch_size or any(s < 1 for s in shares):
        raise ValueError(f"shares must be >= 1 each and sum to batch_size={batch_size}, got {list(shares)}")
    sizes = step_sizes(len(order), batch_size, drop_last)
    workers = len(shares)
    if sizes and min(sizes) < workers:
        raise ValueError(
            f"{len(order)} samples with batch_size={batch_size} give a step of {min(sizes)} samples, fewer than the "
            f"{workers} workers: every worker needs a non-empty batch (use a smaller batch size or more data)"
        )
    batches: list[list[list[int]]] = [[] for _ in range(workers)]
    offset = 0
    for size in sizes:
        parts = list(shares) if size == batch_size else worker_shares(size, [float(s) for s in shares])
        for w, part in enumerate(parts):
            batches[w].append([int(i) for i in order[offset : offset + part]])
            offset += part
    return EpochPlan(step_sizes=sizes, batches=batches)
