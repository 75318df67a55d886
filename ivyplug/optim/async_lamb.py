"""``AsyncLAMB``: LAMB with local steps and delta averaging against the ivyplug parameter server.

Each worker takes ``sync_every`` (H) local LAMB steps from the global copy it last pulled, then pushes its
delta Δ = x_local − x_pulled; the servers merge it as it arrives, ``x ← x + merge_rate · Δ``, and the worker
continues from the fresh global copy (local SGD / DiLoCo with an SGD outer step). LAMB suits this:
its layer-wise trust ratio, clipped to ``max_trust_ratio``, bounds how far one local step, and so one stale
delta of H steps, can move a layer relative to its norm. The exchange and its rules (merge rates per mode,
staleness scaling, non-finite deltas) are :mod:`ivyplug.ps.delta_exchange`'s.

Not attached to a PS, AsyncLAMB is LAMB (one worker, nothing to average).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ivyplug.optim.optimizer import LAMB
from ivyplug.ps.delta_exchange import DeltaExchange, check_merge_rate, check_sync_every

if TYPE_CHECKING:
    from ivyplug.ps import PSClient, PSConfig


class AsyncLAMB(LAMB):
    """LAMB whose workers average their progress through the parameter server every ``sync_every`` steps.

    Args: LAMB's (see :class:`~ivyplug.optim.LAMB`), plus
        sync_every: local steps between two exchanges with the PS (H >= 1; H = 1 pushes after every step).
        merge_rate: how much of a pushed delta the servers apply; ``None``: 1.0 in sync mode, 1/num_workers
            in async/ssp (see :mod:`ivyplug.ps.delta_exchange`).

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
    (``nonfinite="skip"``).
    """

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
        sync_every: int = 4,
        merge_rate: float | None = None,
    ) -> None:
        self.sync_every = check_sync_every(sync_every)
        check_merge_rate(merge_rate)  # before LAMB's own checks: the new argument's error comes first
        super().__init__(
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
        self.local_steps = 0  # since the last exchange
        self.delta = DeltaExchange(self._held(), merge_rate)

    def _held(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def merge_rate(self) -> float | None:
        return self.delta.merge_rate

    @property
    def exchanges(self) -> int:
        return self.delta.exchanges

    @property
    def discarded_exchanges(self) -> int:
        return self.delta.discarded

    @property
    def attached(self) -> bool:
        return self.delta.client is not None

    # -- wiring to a PS ---------------------------------------------------------------------------
    def outer_optimizer(self, mode: str, num_workers: int) -> torch.optim.SGD:
        """The optimizer the servers mirror: pass it as ``optimizer=`` to ``PSClient.start``, then attach."""
        return self.delta.outer_optimizer(mode, num_workers)

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client`` from now on; call after ``client.pull_initial()`` (or any pull)."""
        self.delta.attach(client)
        self.local_steps = 0

    def start_ps(
        self, cfg: PSConfig, params: Sequence[Any], buffers: Sequence[Any] = (), **start_kwargs: Any
    ) -> PSClient:
        """Start a :class:`~ivyplug.ps.PSClient` for this optimizer (collective), pull, attach; returns it.

        ``params``/``buffers``: the model's tensors or (name, tensor) pairs, as for ``PSClient.start``.
        """
        from ivyplug.ps import PSClient

        world = start_kwargs.get("world_size")
        if world is None:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        outer = self.outer_optimizer(cfg.mode, int(world))
        client = PSClient.start(cfg, params, buffers, optimizer=outer, **start_kwargs)
        client.pull_initial()
        self.attach(client)
        return client

    def reset_snapshot(self) -> None:
        """Take the current parameters as the global copy (after a pull that did not go through exchange)."""
        self.delta.reset_snapshot()
        self.local_steps = 0

    # -- stepping ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One local LAMB step; every ``sync_every``-th step also exchanges with the PS."""
        loss = self._lamb_step(closure)  # not super().step(): that would run the step hooks a second time
        if self.attached:
            self.local_steps += 1
            if self.local_steps >= self.sync_every:
                self.exchange()
        return loss

    def exchange(self) -> None:
        """Push this worker's delta, pull the global copy and continue from it."""
        self.delta.exchange(self.local_steps)
        self.local_steps = 0

    def flush(self) -> None:
        """Exchange now if there were local steps since the last exchange (before validating or saving)."""
        if self.attached and self.local_steps > 0:
            self.exchange()

    # -- pickling and checkpoints -----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(
            sync_every=self.sync_every,
            merge_rate=self.merge_rate,
            exchanges=self.exchanges,
            discarded_exchanges=self.discarded_exchanges,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling builds a detached exchange; ``load_state_dict`` (which also lands here) keeps the live one.

        Rebuilding it on load would silently detach a wired optimizer from its PS and drop its ``merge_rate``.
        """
        state = dict(state)
        counts = (int(state.pop("exchanges", 0)), int(state.pop("discarded_exchanges", 0)))
        merge_rate = state.pop("merge_rate", None)
        live = self.__dict__.get("delta")
        super().__setstate__(state)
        self.__dict__.setdefault("sync_every", 4)
        if isinstance(live, DeltaExchange):
            return
        self.local_steps = 0
        self.delta = DeltaExchange(self._held(), merge_rate)  # a copy is not attached to the original's PS
        self.delta.exchanges, self.delta.discarded = counts

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["async_lamb"] = {
            "sync_every": self.sync_every,
            "merge_rate": self.merge_rate,
            "exchanges": self.exchanges,
            "discarded_exchanges": self.discarded_exchanges,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        extra = sd.pop("async_lamb", None) or {}
        super().load_state_dict(sd)
        self.delta.exchanges = int(extra.get("exchanges", 0))
        self.delta.discarded = int(extra.get("discarded_exchanges", 0))
