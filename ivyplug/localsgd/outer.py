"""``DelayedNesterov``: Nesterov SGD whose momentum is applied once every ``momentum_every`` steps.

An outer optimizer for local updates (:class:`ivyplug.optim.LocalUpdates`): the servers mirror it and step it
with the pseudo-gradient g = −Δ of every merged delta. Asynchronous merges apply one worker's delta at a time,
and a momentum buffer stepped at every merge accelerates along stale directions; the delayed Nesterov update
of Liu et al. 2024 ("Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135, the variant
without the in-between momentum term) applies the plain gradient at every merge and the momentum once per N
merges, from the mean of those N gradients. Per parameter, at its k-th step (k = 1, 2, ...):

    a ← a + g
    k mod N ≠ 0:  x ← x − lr · g / N
    k mod N = 0:  m ← β·m + a / N;  x ← x − lr · (g / N + β·m);  a ← 0

Over one cycle of N steps x moves by −lr · (mean(g) + β·m), one Nesterov step over the mean gradient; N = 1
is ``torch.optim.SGD(lr, momentum=β, nesterov=True)`` (m ← β·m + g; x ← x − lr · (g + β·m)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["DelayedNesterov"]


def _check(lr: object, momentum: object, momentum_every: object) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if isinstance(momentum_every, bool) or not isinstance(momentum_every, int) or momentum_every < 1:
        raise ValueError(f"momentum_every must be an int >= 1, got {momentum_every!r}")


class DelayedNesterov(torch.optim.Optimizer):
    """Nesterov SGD with its momentum applied once per ``momentum_every`` steps (see the module docstring).

    Element-wise and stateless across parameters: each parameter keeps its step count ``step``, its
    momentum ``momentum_buffer`` and the gradient sum ``accum`` of the current cycle (all in ``state_dict``).
    A parameter without a gradient is not stepped and does not count the step.

    Args:
        params: parameters or param groups.
        lr: learning rate (the outer learning rate), >= 0.
        momentum: β in [0, 1).
        momentum_every: N >= 1, steps per momentum update.

    Example:
        >>> import torch
        >>> from ivyplug.optim import DelayedNesterov
        >>> x = torch.nn.Parameter(torch.zeros(2))
        >>> opt = DelayedNesterov([x], lr=1.0, momentum=0.5, momentum_every=2)
        >>> for _ in range(2):
        ...     x.grad = torch.ones(2); opt.step()
        >>> x.tolist()  # −(1/2) − (1/2 + 0.5 · 1)
        [-1.5, -1.5]
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.7,
        momentum: float = 0.9,
        momentum_every: int = 1,
    ) -> None:
        _check(lr, momentum, momentum_every)
        super().__init__(params, {"lr": lr, "momentum": momentum, "momentum_every": momentum_every})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check(group["lr"], group["momentum"], group["momentum_every"])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, every = float(group["lr"]), float(group["momentum"]), int(group["momentum_every"])
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("DelayedNesterov does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["accum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = int(state["step"]) + 1
                acc, buf = state["accum"], state["momentum_buffer"]
                acc.add_(g)
                if state["step"] % every:
                    p.add_(g, alpha=-lr / every)
                    continue
                buf.mul_(beta).add_(acc, alpha=1.0 / every)
                acc.zero_()
                p.add_(g, alpha=-lr / every).add_(buf, alpha=-lr * beta)
        return loss
