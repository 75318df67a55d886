"""Where the Lightning ``IvyLoadBalancer`` sees the gradient at two batch sizes, and the per-step sums it keeps.

The gradient noise scale needs, in one step, a rank's own gradient at its b samples and the combined one at B.
Under ``ddp`` the share-weighting hook sees both (before and after its all-reduce); under ``ivy_ps`` sync the
rank's own comes from ``.grad`` before the push and the combined norm from the servers' reply. Elsewhere there
is none, and :func:`noise_source` says why. The sums stay tensors (no device sync per step) until the epoch end.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy


def noise_source(strategy: Any, world: int) -> tuple[str | None, bool]:
    """``(why there is no estimate, whether the ivy_ps servers report the combined norm)`` for this strategy."""
    ps_config = getattr(strategy, "ps_config", None)
    if world == 1:
        return "one process sees its gradient at one batch size only, the noise scale needs two", False
    if ps_config is not None and getattr(strategy, "is_async", False):
        return (
            f"under ivy_ps {ps_config.mode} the servers apply each worker's push on arrival, alone, so no step "
            "has a combined gradient of several workers, and the noise scale needs the gradient at two batch "
            "sizes of one step"
        ), False
    if ps_config is not None:  # sync: the servers report the combined gradient's norm with each step
        return None, True
    if not isinstance(strategy, DDPStrategy):
        return (
            f"under {type(strategy).__name__} the combined gradient is formed where this callback cannot see it, "
            "the noise scale needs it"
        ), False
    return None, False


def own_grad_sq(module: torch.nn.Module) -> torch.Tensor | None:
    """|this rank's gradient|² as a 0-d tensor (no device sync), ``None`` without gradients."""
    grads = [p.grad.detach() for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()


class NoiseSums:
    """This epoch's sums of the per-step (|G|², tr(Σ)) estimates, and how many steps gave a finite one."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, small_sq: torch.Tensor, b: int, big_sq: torch.Tensor, big: int) -> None:
        """One step's estimate (:func:`~ivyplug.load.goodput.noise_components`, as tensors); a non-finite one is
        left out and not counted."""
        big_sq = big_sq.to(small_sq.device)
        values = torch.stack([(big * big_sq - b * small_sq) / (big - b), (small_sq - big_sq) / (1.0 / b - 1.0 / big)])
        finite = torch.isfinite(values).all()
        values = torch.where(finite, values, torch.zeros_like(values))
        if self.total is None or self.count is None:
            self.total, self.count = values, finite.to(values.dtype)
        else:
            self.total = self.total + values
            self.count = self.count + finite.to(values.dtype)

    def record(self) -> dict[str, float]:
        """The epoch means, as the core's record keys: the one device sync per epoch."""
        if self.total is None or self.count is None:
            return {"noise_grad_sq": 0.0, "noise_trace": 0.0, "noise_steps": 0}
        count = int(self.count.item())
        grad_sq, trace = (self.total / max(count, 1)).tolist()
        return {"noise_grad_sq": float(grad_sq), "noise_trace": float(trace), "noise_steps": count}


def fit_noise_source(unavailable: str | None, ps_noise: bool, ddp: bool, optimizers: Any) -> tuple[str | None, bool]:
    """:func:`noise_source`'s answer once the model is wrapped: under DDP the share hook sees both gradients; under
    ivy_ps sync a local-update optimizer pushes deltas; elsewhere without DDP no gradient is seen."""
    if ddp:
        return unavailable, ps_noise
    if ps_noise:
        from ivyplug.localsgd.optimizer_protocol import DeltaExchangingOptimizer

        if any(isinstance(opt, DeltaExchangingOptimizer) for opt in optimizers):
            return (
                "a local-update optimizer (AsyncLAMB) pushes parameter deltas, not gradients, so the servers' "
                "combined norm is not a gradient's"
            ), False
        return unavailable, True
    if unavailable is None:
        return "the model is not wrapped in DistributedDataParallel, so no gradient is seen", False
    return unavailable, False


def warn_no_estimate(reason: str, monitoring_only: bool) -> None:
    """Say once (rank 0) that B will not grow for want of a noise-scale estimate, and why."""
    from lightning.pytorch.utilities import rank_zero_warn

    held = (
        "the batch size and shares stay fixed (monitoring only)"
        if monitoring_only
        else "the batch size will not grow (it still shrinks on memory pressure)"
    )
    rank_zero_warn(
        f"IvyLoadBalancer(goodput=True): no gradient noise scale estimate: {reason}; {held}. "
        "Pass goodput=False to let utilisation and memory alone decide.",
        stacklevel=5,  # the callback hook that asked
    )
