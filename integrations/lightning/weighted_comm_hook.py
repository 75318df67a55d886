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

    def new_step(self, weight: float) -> None:
        """Start a step whose gradient is weighted by ``weight`` (b_i/B): forget the last step's stamps and norms."""
        self.weight = weight
        self.last_bucket_time = None
        if self.measure_noise:
            self.local_sq.clear()
            self.combined_sq.clear()

    def step_norms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(|own gradient|², |combined gradient|²)`` of the step just run, summed over buckets, if measured."""
        if not self.measure_noise or not self.local_sq or len(self.local_sq) != len(self.combined_sq):
            return None
        return torch.stack(self.local_sq).sum(), torch.stack(self.combined_sq).sum()


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


def register_share_hook(model: Any, world: int, user: tuple[Any, Any] | None, measure_noise: bool) -> ShareHookState:
    """Register :func:`share_weighted_hook` on a ``DistributedDataParallel`` model (``user``: a hook to compose)."""
    user_hook, user_state = user if user is not None else (None, None)
    state = ShareHookState(
        world_size=world, process_group=model.process_group, user_hook=user_hook, user_state=user_state
    )
    state.measure_noise = measure_noise
    try:
        model.register_comm_hook(state, share_weighted_hook)
    except RuntimeError as exc:
        raise RuntimeError(
            "IvyLoadBalancer could not register its gradient-weighting DDP communication hook: the model "
            "already has one (torch allows one per model). Pass your hook as DDPStrategy(ddp_comm_hook=...) "
            f"so IvyLoadBalancer can compose it, or remove it. Original error: {exc}"
        ) from exc
    return state
