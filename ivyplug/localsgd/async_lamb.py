"""``AsyncLAMB``: LAMB with local steps and delta merging against the ivyplug parameter server.

LAMB in the :class:`~ivyplug.optim.LocalUpdates` wrapper. Each worker takes ``sync_every`` local LAMB steps from
the global copy it last pulled, then pushes its delta Δ = x_local − x_pulled; the servers merge it as it arrives
with the outer optimizer chosen by ``outer`` (default ``"average"``: ``x ← x + merge_rate · Δ``, local SGD with
an SGD outer step; ``"nesterov"``: DiLoCo's outer Nesterov step; ``"lamb"``: an outer LAMB step, see docs/design.md
"Outer optimizers"), and the worker continues from the fresh global copy. LAMB suits this: its layer-wise trust
ratio, clipped to ``max_trust_ratio``, bounds how far one local step, and so one stale delta of H steps, can
move a layer relative to its norm. The exchange and its rules (merge rates per mode, staleness scaling,
non-finite deltas) are :mod:`ivyplug.localsgd.delta_exchange`'s.

Not attached to a PS, AsyncLAMB is LAMB (one worker, nothing to average).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ivyplug.localsgd.delta_exchange import OuterRule, check_overlap
from ivyplug.localsgd.local_updates import LocalUpdates
from ivyplug.localsgd.sync_period import SyncEvery, check_sync_period
from ivyplug.optim.optimizer import LAMB


class AsyncLAMB(LocalUpdates):
    """LAMB whose workers merge their progress through the parameter server every ``sync_every`` steps.

    Args: LAMB's (see :class:`~ivyplug.optim.LAMB`), plus
        sync_every: local steps between two exchanges with the PS (H >= 1; H = 1 pushes after every step), or
            ``"auto"``: chosen from the measured step and exchange times (see :class:`~ivyplug.optim.LocalUpdates`).
        merge_rate: ``outer="average"``: how much of a pushed delta the servers apply; ``None``: 1.0 in sync
            mode, 1/num_workers in async/ssp (see :mod:`ivyplug.localsgd.delta_exchange`).
        outer, outer_lr, outer_momentum, outer_momentum_every: the outer optimizer, as for
            :class:`~ivyplug.optim.LocalUpdates`; ``outer="lamb"`` clips its trust ratio to ``max_trust_ratio``.
        overlap: exchange in the background while local steps go on (one exchange stale; mode ``"sync"`` or
            ``"async"``), see :class:`~ivyplug.optim.LocalUpdates`.

    Example:
        >>> import torch
        >>> from ivyplug.optim import AsyncLAMB
        >>> from ivyplug.ps import PSConfig
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AsyncLAMB(model.parameters(), lr=1e-2, sync_every=4)
        >>> client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))
        >>> loss = model(torch.randn(8, 4)).square().mean()
        >>> loss.backward(); opt.step(); opt.zero_grad()  # every 4th step exchanges with the PS
        >>> opt.flush(); client.sync(); client.close()
        >>> opt.exchanges
        1

    Under ``Trainer(strategy="ivy_ps")`` the strategy does the wiring. ``exchanges`` counts pushes;
    ``discarded_exchanges`` counts deltas holding a NaN/Inf that the PS dropped
    (``nonfinite="skip"``). ``inner`` is the LAMB that takes the local steps.
    """

    state_key = "async_lamb"
    inner: LAMB

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: float = 10.0,
        min_trust_ratio: float = 0.0,
        max_grad_norm: float | None = None,
        foreach: bool | None = None,
        *,
        sync_every: SyncEvery = 4,
        merge_rate: float | None = None,
        outer: str = "average",
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_momentum_every: int | None = None,
        overlap: bool = False,
    ) -> None:
        # the new arguments' errors come before LAMB's own checks
        check_sync_period(sync_every)
        check_overlap(overlap)
        OuterRule(outer, merge_rate, outer_lr, outer_momentum, outer_momentum_every, 1.0)
        lamb = LAMB(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_trust_ratio=max_trust_ratio,
            min_trust_ratio=min_trust_ratio,
            max_grad_norm=max_grad_norm,
            foreach=foreach,
        )
        super().__init__(
            lamb,
            sync_every=sync_every,
            outer=outer,
            merge_rate=merge_rate,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_momentum_every=outer_momentum_every,
            max_trust_ratio=max_trust_ratio,
            overlap=overlap,
        )

    # -- LAMB's own attributes --------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Local LAMB steps skipped because a gradient was not finite."""
        return self.inner.skipped_steps

    @property
    def max_grad_norm(self) -> float | None:
        return self.inner.max_grad_norm

    def trust_ratios(self) -> dict[Tensor, float]:
        """The trust ratio each parameter got in the last local step (see :meth:`LAMB.trust_ratios`)."""
        return self.inner.trust_ratios()
