"""A DDP communication hook that weights each rank's gradient by its share b_i/B before summing.

With uneven per-rank batches an equal-weight mean of the ranks' mean gradients is biased; the
full-batch mean is Σ_i (b_i/B)·g_i. The hook multiplies the bucket by b_i/B and all-reduces with
SUM. A user's own hook (torch allows one per model) is composed: the bucket is pre-scaled by
W·b_i/B and handed to it, which is right for every hook that ends in a mean over W ranks (the
default all-reduce, fp16/bf16 compression, PowerSGD). The hook also stamps the time at which the
last bucket is ready: the end of this rank's own backward compute, before any waiting for others.

With ``measure_noise`` the hook also keeps, per bucket, the squared norm of this rank's own gradient (the
buffer before weighting: the mean over its b_i samples) and of the combined one (the reduced buffer: the
mean over all B samples), as 0-d tensors: no device sync per step. The load balancer turns the two into a
gradient noise scale estimate (:mod:`ivyplug.load.goodput`). This is the only place where both are visible
under DDP: after backward ``.grad`` already holds the combined gradient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ShareHookState:
    """Mutable state read by the hook at every step; the callback sets ``weight`` per step."""

    world_size: int
    process_group: Any = None
    weight: float = 1.0
    user_hook: Callable[[Any, Any], torch.futures.Future] | None = None
    user_state: Any = None
    last_bucket_time: float | None = None
    calls: int = field(default=0)
    measure_noise: bool = False
    local_sq: list[torch.Tensor] = field(default_factory=list)  # this step, per bucket: |own gradient|²
    combined_sq: list[torch.Tensor] = field(default_factory=list)  # this step, per bucket: |combined|²


def _sq_norm(tensor: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32).square()


def share_weighted_hook(state: ShareHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale by b_i/B and all-reduce SUM (or pre-scale and delegate to the user's hook)."""
    state.calls += 1
    if bucket.is_last():
        state.last_bucket_time = time.perf_counter()
    buffer = bucket.buffer()
    if state.measure_noise:
        state.local_sq.append(_sq_norm(buffer))  # list.append: safe from the reducer's threads
    if state.user_hook is not None:
        buffer.mul_(state.weight * state.world_size)
        future = state.user_hook(state.user_state, bucket)
        if not state.measure_noise:
            return future
        return future.then(lambda fut: _record_combined(state, fut.value()))
    buffer.mul_(state.weight)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    if state.measure_noise:
        return work.get_future().then(lambda fut: _record_combined(state, fut.value()[0]))
    return work.get_future().then(lambda fut: fut.value()[0])


def _record_combined(state: ShareHookState, reduced: Any) -> Any:
    """Keep |reduced|² and pass the reduced bucket on unchanged (a hook's future may hold a one-element list)."""
    tensor = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
    state.combined_sq.append(_sq_norm(tensor))
    return reduced


# DDP checks the hook's annotations against the real classes; postponed (string) annotations fail that check.
share_weighted_hook.__annotations__ = {
    "state": ShareHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
