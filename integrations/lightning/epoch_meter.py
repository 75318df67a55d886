"""What one rank measures over one epoch for the Lightning ``IvyLoadBalancer``: step times, samples, noise sums.

Per step only the clock is read and integers added (no tensor op, no device query), except where the goodput
rule needs a gradient norm; :meth:`EpochMeter.record` turns the epoch into the record the balancer core reads.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from ivyplug.integrations.lightning.balancer_noise import NoiseSums, own_grad_sq
from ivyplug.integrations.lightning.weighted_comm_hook import ShareHookState

from ivyplug.load.observation import LoadObservation
from ivyplug.load.oom import batch_length


def samples_in(batch: Any) -> int:
    """A batch's sample count (its leading dimension), 1 where it has none."""
    try:
        return batch_length(batch)
    except ValueError:
        return 1


class EpochMeter:
    """One rank's epoch: compute seconds per step (batch start to its last gradient bucket), samples, walls."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.step_computes: list[float] = []  # per step, for the median the share fit uses
        self.step_shares: list[int] = []
        self.samples = 0
        self.steps = 0
        self.ooms = 0
        self.step_samples = 0  # this step: this rank's samples and the global ones
        self.step_global = 0
        self.walls: list[float] = []  # wall seconds between consecutive batch ends
        self.noise = NoiseSums()
        self._t0 = 0.0
        self._t_backward: float | None = None
        self._last_end = time.perf_counter()
        # ivy_ps sync: this rank's and the global samples of the micro-batches since the last optimizer step, and
        # (|own gradient|², b, B) of an optimizer step whose combined norm the PS reports after the push
        self._since_local = 0
        self._since_global = 0
        self.ps_pending: tuple[torch.Tensor, int, int] | None = None

    def batch_start(self, local: int, total: int) -> None:
        self.step_samples, self.step_global = local, total
        self._since_local += local
        self._since_global += total
        self._t_backward = None
        self._t0 = time.perf_counter()

    def backward_done(self) -> None:
        self._t_backward = time.perf_counter()

    def optimizer_step(self, module: torch.nn.Module, measure: bool) -> None:
        """Close the samples of this optimizer step; with ``measure``, keep |own gradient|² at them (b of B)."""
        b, big = self._since_local, self._since_global
        self._since_local = self._since_global = 0
        small_sq = own_grad_sq(module) if measure and big > b > 0 else None
        if small_sq is not None:
            self.ps_pending = (small_sq, b, big)

    def batch_end(self, now: float, hook_state: ShareHookState | None, accumulate: int, ps_norm: Any) -> None:
        """Count the step; add its noise estimate from the DDP hook's norms, or from the PS's reported one."""
        end = hook_state.last_bucket_time if hook_state is not None else None
        if end is None:
            end = self._t_backward if self._t_backward is not None else now
        compute = max(end - self._t0, 0.0)
        self.compute += compute
        self.step_computes.append(compute)
        self.step_shares.append(self.step_samples)
        self.samples += self.step_samples
        self.steps += 1
        self.walls.append(now - self._last_end)
        self._last_end = now
        norms = hook_state.step_norms() if hook_state is not None else None
        b, big = self.step_samples * accumulate, self.step_global * accumulate
        if norms is not None and big > b:
            self.noise.add(norms[0], b, norms[1], big)
        if self.ps_pending is not None:  # the optimizer step ran: the PS reply carried the combined norm
            small_sq, b, big = self.ps_pending
            if ps_norm is not None:  # None: not reported for this step
                self.noise.add(small_sq, b, torch.tensor(float(ps_norm), dtype=small_sq.dtype), big)
            self.ps_pending = None

    def record(self, rank: int, share: int, observation: LoadObservation) -> dict[str, Any]:
        """This rank's epoch record (the keys :meth:`ivyplug.load.balancer.BalancerCore.decide_epoch` reads)."""
        return {
            "rank": rank,
            "compute_time": self.compute,
            "samples": self.samples,
            "steps": self.steps,
            # medians, not means: on a shared machine a few preempted steps would tilt the step-time fit
            "step_share": statistics.median(self.step_shares) if self.step_shares else 0.0,
            "step_time": statistics.median(self.step_computes) if self.step_computes else 0.0,
            "wall_step": statistics.median(self.walls) if self.walls else 0.0,
            **self.noise.record(),
            "utilization": observation.utilization,
            "memory_fraction": observation.memory_fraction,
            "oom_count": self.ooms,
            "share": share,
        }
