"""``AsyncLAMB``: LAMB with local steps and delta averaging against the ivyplug parameter server.

Each worker takes ``sync_every`` (H) local LAMB steps from the global copy it last pulled, then pushes its
delta Δ = x_local − x_pulled; the servers merge it as it arrives, ``x ← x + merge_rate · Δ``, and the worker
continues from the fresh global copy (local SGD / DiLoCo with an SGD outer step; BRIEF §4). LAMB suits this:
its layer-wise trust ratio, clipped to ``max_trust_ratio``, bounds how far one local step, and so one stale
delta of H steps, can move a layer relative to its norm.

The merge runs on the existing PS machinery: the servers mirror an *outer* optimizer, plain SGD with
``lr = merge_rate`` over the same parameters, and the worker pushes the pseudo-gradient x_pulled − x_local
(= −Δ). So every PS rule holds unchanged: sync mode combines the workers' deltas weighted by their local
step counts (their mean, for equal H) before one merge; async/ssp merge each delta on arrival, scaled by
1/τ when stale (``staleness_scaling="inverse"``); buffers follow the PS buffer rule at every exchange.

``merge_rate=None`` picks 1.0 in sync mode (the global copy moves by the mean delta, as one big step of
all workers together) and 1/num_workers in async/ssp (after every worker pushed once, the global copy moved
by the mean of their deltas). Not attached to a PS, AsyncLAMB is LAMB (one worker, nothing to average).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ivyplug.optim.optimizer import LAMB

if TYPE_CHECKING:
    from ivyplug.ps import PSClient, PSConfig


def _check_sync_every(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sync_every must be an int >= 1 (local steps between exchanges), got {value!r}")
    return value


def _check_merge_rate(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"merge_rate must be None or a finite number > 0, got {value!r}")
    return float(value)


class AsyncLAMB(LAMB):
    """LAMB whose workers average their progress through the parameter server every ``sync_every`` steps.

    Args: LAMB's (see :class:`~ivyplug.optim.LAMB`), plus
        sync_every: local steps between two exchanges with the PS (H >= 1; H = 1 pushes after every step).
        merge_rate: how much of a pushed delta the servers apply; ``None``: 1.0 in sync mode, 1/num_workers
            in async/ssp (see the module docstring).

    Example:
        >>> import torch
        >>> from ivyplug.optim import AsyncLAMB
        >>> from ivyplug.ps import PSConfig
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AsyncLAMB(model.parameters(), lr=1e-2, sync_every=4)
        >>> client = opt.start_ps(PSConfig(mode="async"), list(model.named_parameters()))  # doctest: +SKIP
        >>> # training loop: loss.backward(); opt.step(); opt.zero_grad() -- every 4th step exchanges
        >>> opt.flush(); client.sync(); client.close()  # doctest: +SKIP

    ``exchanges`` counts pushes; ``discarded_exchanges`` counts deltas that were not finite and were replaced
    by a zero delta (the worker then restarts from the global copy: nothing non-finite reaches the servers).
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
        self.sync_every = _check_sync_every(sync_every)
        self.merge_rate = _check_merge_rate(merge_rate)
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
        self.exchanges = 0
        self.discarded_exchanges = 0
        self.local_steps = 0  # since the last exchange
        self._client: PSClient | None = None
        self._outer: torch.optim.SGD | None = None
        self._snapshot: list[Tensor] = []

    # -- wiring to a PS ---------------------------------------------------------------------------
    def _held(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def outer_optimizer(self, mode: str, num_workers: int) -> torch.optim.SGD:
        """The optimizer the servers mirror: SGD with ``lr = merge_rate`` over this optimizer's parameters.

        Pass it as ``optimizer=`` to :meth:`ivyplug.ps.PSClient.start`, then call :meth:`attach`.
        """
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if mode not in ("sync", "async", "ssp"):
            raise ValueError(f"mode must be 'sync', 'async' or 'ssp', got {mode!r}")
        rate = self.merge_rate
        if rate is None:
            rate = 1.0 if mode == "sync" else 1.0 / num_workers
        self._outer = torch.optim.SGD(self._held(), lr=rate)
        return self._outer

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client`` from now on; the current parameters are the pulled global copy.

        Call after ``client.pull_initial()`` (or any pull). The client must have been started with
        :meth:`outer_optimizer`'s result, or the servers would run another update rule on the deltas.
        """
        if self._outer is None or client.optimizer is not self._outer:
            raise ValueError(
                "attach() needs a PSClient started with optimizer=AsyncLAMB.outer_optimizer(mode, num_workers)"
            )
        self._client = client
        self.reset_snapshot()

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
        """Take the current parameters as the global copy the next delta is measured from."""
        self._snapshot = [p.detach().clone() for p in self._held()]
        self.local_steps = 0

    @property
    def attached(self) -> bool:
        return self._client is not None

    # -- stepping ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One local LAMB step; every ``sync_every``-th step also exchanges with the PS."""
        loss = super().step(closure)
        if self._client is not None:
            self.local_steps += 1
            if self.local_steps >= self.sync_every:
                self.exchange()
        return loss

    @torch.no_grad()
    def exchange(self) -> None:
        """Push Δ = x_local − x_pulled (as the pseudo-gradient −Δ), pull the global copy, restart from it."""
        client = self._client
        if client is None:
            raise RuntimeError("AsyncLAMB.exchange() needs a PS: call start_ps() or attach() first")
        held = self._held()
        saved = [p.grad for p in held]
        pseudo = [s - p.detach() for s, p in zip(self._snapshot, held, strict=True)]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in pseudo])) if pseudo else 0
        if not math.isfinite(float(total)):
            for g in pseudo:
                g.zero_()
            self.discarded_exchanges += 1
        try:
            for p, g in zip(held, pseudo, strict=True):
                p.grad = g
            client.step(max(1, self.local_steps))
        finally:
            for p, old in zip(held, saved, strict=True):
                p.grad = old
        self.exchanges += 1
        self.reset_snapshot()

    def flush(self) -> None:
        """Exchange now if there were local steps since the last exchange (before validating or saving)."""
        if self._client is not None and self.local_steps > 0:
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
        super().__setstate__(state)
        self.__dict__.setdefault("sync_every", 4)
        self.__dict__.setdefault("merge_rate", None)
        self.__dict__.setdefault("exchanges", 0)
        self.__dict__.setdefault("discarded_exchanges", 0)
        self.local_steps = 0
        self._client = None  # a copy is not attached: the PS connection belongs to the original
        self._outer = None
        self._snapshot = []

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
        self.exchanges = int(extra.get("exchanges", 0))
        self.discarded_exchanges = int(extra.get("discarded_exchanges", 0))
