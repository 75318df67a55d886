"""``LocalUpdates``: any torch optimizer with local steps and outer merges of its deltas through the PS.

A wrapper, in the style of torch's ``PostLocalSGDOptimizer`` and hivemind's ``Optimizer(use_local_updates=True)``:
the inner optimizer steps on the worker; every ``sync_every`` (H) steps the wrapper pushes the delta
Δ = x_local − x_pulled and continues from the global copy the servers send back. The servers merge each delta
with the *outer* optimizer chosen by ``outer`` (:class:`ivyplug.localsgd.delta_exchange.OuterRule`, formulas in
docs/design.md, "Outer optimizers"): ``"average"`` (x ← x + merge_rate · Δ), ``"nesterov"`` (DiLoCo's Nesterov
SGD over the pseudo-gradient −Δ, with delayed momentum for asynchronous merges) or ``"lamb"`` (LAMB over
−Δ: its clipped trust ratio bounds how far one merge moves a layer). The exchange itself (merge rates per mode,
staleness, non-finite deltas) is :mod:`ivyplug.localsgd.delta_exchange`'s.

The wrapper implements the :class:`ivyplug.localsgd.optimizer_protocol.DeltaExchangingOptimizer` protocol, so
``Trainer(strategy="ivy_ps")`` runs it as it runs :class:`~ivyplug.optim.AsyncLAMB`. Not attached to a PS it is
its inner optimizer. Its ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's (LR schedulers
edit the inner learning rates); step hooks registered on the wrapper, on the inner optimizer or globally run once
per ``step()`` (the global ones with the wrapper's, the inner instance's around its step).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ivyplug.localsgd.delta_exchange import DeltaExchange, OuterRule, check_overlap
from ivyplug.localsgd.sync_period import SyncEvery, SyncPeriod, check_sync_period

if TYPE_CHECKING:
    from ivyplug.ps import PSClient, PSConfig

__all__ = ["LocalUpdates"]

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class LocalUpdates(torch.optim.Optimizer):
    """Wraps ``inner``: local steps, and every ``sync_every`` steps a delta merged by the servers' outer optimizer.

    Args:
        inner: the worker's torch optimizer (any ``torch.optim.Optimizer`` over the model's parameters).
        sync_every: local steps between two exchanges with the PS (H >= 1; H = 1 pushes after every step), or
            ``"auto"``: chosen from this worker's measured step and exchange times so that exchanges take at most
            10% of its time, re-chosen by :meth:`retune_sync_every` (every epoch under Lightning); a slower worker
            then takes fewer steps per exchange (:mod:`ivyplug.localsgd.sync_period`). :attr:`sync_every` is the
            current H.
        outer: ``"average"``, ``"nesterov"`` or ``"lamb"``: how the servers merge a delta.
        merge_rate: ``"average"``: the share of a delta applied; ``None``: 1.0 in sync mode, 1/num_workers in
            async/ssp.
        outer_lr: ``"nesterov"``/``"lamb"``: the outer learning rate; ``None``: 0.7 for nesterov, 0.04 for lamb
            in sync mode (0.04/num_workers in async/ssp).
        outer_momentum: Nesterov's momentum β, LAMB's β1; ``None``: 0.5 for nesterov, 0.9 for lamb (see
            :data:`ivyplug.localsgd.delta_exchange.DEFAULT_OUTER_MOMENTUM`).
        outer_momentum_every: ``"nesterov"``: merges per momentum update (delayed Nesterov); ``None``: 1 in
            sync mode, num_workers in async/ssp.
        max_trust_ratio: ``"lamb"``: the upper clip of the outer trust ratio; default 10.0.
        overlap: run each exchange in the background while the worker keeps taking local steps (mode
            ``"sync"`` or ``"async"``): at the next exchange point the worker continues from the pulled global
            copy plus the progress made since the push, ``x ← g + (x − x_sent)``, one exchange stale (see
            :mod:`ivyplug.localsgd.delta_exchange`). The PSClient must then be started over :meth:`ps_tensors`
            (:meth:`start_ps` and the Lightning strategy do so). Default False.

    Example:
        >>> import torch
        >>> from ivyplug.optim import LocalUpdates
        >>> from ivyplug.ps import PSConfig
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LocalUpdates(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=2, outer="nesterov")
        >>> client = opt.start_ps(PSConfig(mode="sync"), list(model.named_parameters()))
        >>> for _ in range(4):
        ...     model(torch.randn(8, 4)).square().mean().backward(); opt.step(); opt.zero_grad()
        >>> opt.exchanges, type(client.optimizer).__name__
        (2, 'SGD')
        >>> client.close()

    ``exchanges`` counts pushes; ``discarded_exchanges`` counts deltas holding a NaN/Inf that the PS dropped.
    """

    #: The key under which :meth:`state_dict` keeps the wrapper's settings and counters.
    state_key = "local_updates"

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        sync_every: SyncEvery = 4,
        outer: str = "average",
        merge_rate: float | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_momentum_every: int | None = None,
        max_trust_ratio: float = 10.0,
        overlap: bool = False,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if isinstance(inner, LocalUpdates):
            raise ValueError("inner is already a LocalUpdates optimizer: wrap its inner optimizer instead")
        sync_every = check_sync_period(sync_every)
        rule = OuterRule(outer, merge_rate, outer_lr, outer_momentum, outer_momentum_every, max_trust_ratio)
        self._setup(inner, sync_every, rule, overlap=check_overlap(overlap))

    def _setup(
        self,
        inner: torch.optim.Optimizer,
        sync_every: SyncEvery,
        rule: OuterRule,
        counts: tuple[int, int] = (0, 0),
        overlap: bool = False,
    ) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets up, minus the param groups (those are ``inner``'s)."""
        self.inner = inner
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.period = SyncPeriod(sync_every)
        self.local_steps = 0  # since the last exchange
        self.delta = DeltaExchange(self._held(), rule=rule, overlap=overlap)
        self.delta.exchanges, self.delta.discarded = counts

    # -- the inner optimizer's groups and state ---------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> defaultdict[Tensor, Any]:
        return self.inner.state

    @state.setter
    def state(self, value: defaultdict[Tensor, Any]) -> None:
        self.inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def _held(self) -> list[Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (before the PS starts: the servers hold the parameters then)."""
        if self.attached:
            raise RuntimeError("add_param_group() after the PS started: the servers hold a fixed set of parameters")
        self.inner.add_param_group(param_group)
        self.delta.params = self._held()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    # -- settings and counters --------------------------------------------------------------------
    @property
    def rule(self) -> OuterRule:
        """The outer rule (``outer``, ``merge_rate``, ``outer_lr``, ...) the servers merge with."""
        return self.delta.rule

    @property
    def outer(self) -> str:
        return self.delta.rule.outer

    @property
    def merge_rate(self) -> float | None:
        return self.delta.merge_rate

    @property
    def sync_every(self) -> int:
        """The current number of local steps between two exchanges (chosen from measured times with ``"auto"``)."""
        return self.period.value

    @sync_every.setter
    def sync_every(self, value: SyncEvery) -> None:
        self.period = SyncPeriod(value)

    def retune_sync_every(self) -> int:
        """``sync_every="auto"``: choose H again from the recent step and exchange times; returns the current H."""
        return self.period.retune()

    @property
    def overlap(self) -> bool:
        """Whether exchanges run in the background while local steps go on."""
        return self.delta.overlap

    @property
    def overlap_wait_s(self) -> float:
        """``overlap``: seconds this worker waited for an exchange in flight, in total."""
        return self.delta.wait_seconds

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
    def outer_optimizer(self, mode: str, num_workers: int) -> torch.optim.Optimizer:
        """The optimizer the servers mirror: pass it as ``optimizer=`` to ``PSClient.start``, then attach."""
        return self.delta.outer_optimizer(mode, num_workers)

    def ps_tensors(self, params: Sequence[Any], buffers: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
        """What to start the PSClient over: shadow copies of ``params``/``buffers`` with ``overlap`` (the
        background exchange writes those, never the model), else the same tensors. Tensors or (name, tensor)
        pairs, returned in the same form."""
        return self.delta.ps_tensors(params, buffers)

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client`` from now on; call after ``client.pull_initial()`` (or any pull)."""
        self.delta.attach(client)
        self.local_steps = 0

    def detach(self) -> None:
        """Wait for an exchange in flight and drop it, then forget the client (teardown, before its close)."""
        self.delta.close()
        self.delta.client = None

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
        params, buffers = self.ps_tensors(params, buffers)
        outer = self.outer_optimizer(cfg.mode, int(world))
        client = PSClient.start(cfg, params, buffers, optimizer=outer, **start_kwargs)
        client.pull_initial()
        self.attach(client)
        return client

    def reset_snapshot(self) -> None:
        """Take the current parameters as the global copy (after a pull that did not go through exchange).

        ``overlap``: the model's params and buffers become the client's (the global copy last pulled).
        """
        self.delta.reset_snapshot()
        self.local_steps = 0

    # -- stepping ---------------------------------------------------------------------------------
    def _inner_step(self, closure: Callable[[], float] | None) -> Any:
        """``inner.step`` without the global hooks (the wrapper's step already ran them), with the inner
        instance's own step hooks, in torch's order (pre hooks may replace the arguments)."""
        inner = self.inner
        plain = getattr(type(inner).step, "__wrapped__", None)
        if plain is None or "step" in vars(inner):  # e.g. an LR scheduler attached to the inner optimizer
            return inner.step(closure) if closure is not None else inner.step()
        args: tuple[Any, ...] = (closure,) if closure is not None else ()
        kwargs: dict[str, Any] = {}
        for pre_hook in list(inner._optimizer_step_pre_hooks.values()):
            result = pre_hook(inner, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                args, kwargs = result
        out = plain(inner, *args, **kwargs)
        for post_hook in list(inner._optimizer_step_post_hooks.values()):
            post_hook(inner, args, kwargs)
        return out

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One local step of the inner optimizer; every ``sync_every``-th step also exchanges with the PS."""
        if self.delta.overlap:
            self.delta.raise_failed()  # an exchange that failed in the background stops training here
        loss = self._inner_step(closure)
        if self.attached:
            self.local_steps += 1
            self.period.step_ended()
            if self.local_steps >= self.sync_every:
                self.exchange()
        return loss  # type: ignore[no-any-return]

    def exchange(self) -> None:
        """Push this worker's delta, pull the global copy and continue from it (``overlap``: apply the
        exchange in flight and start this one in the background)."""
        self.delta.timed_exchange(self.local_steps, self.period)
        self.local_steps = 0

    def flush(self) -> None:
        """Exchange now if there were local steps since the last exchange (before validating or saving).

        ``overlap``: the exchange in flight is applied first, and this one is waited for.
        """
        if self.attached and self.delta.overlap:
            self.delta.finish()
        if self.attached and self.local_steps > 0:
            self.exchange()
            if self.delta.overlap:
                self.delta.finish()
        self.period.pause()  # what runs next (validation, saving) is no local step

    # -- pickling and checkpoints -----------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        rule = self.delta.rule
        return {
            "sync_every": self.period.setting,
            "outer": rule.outer,
            "merge_rate": rule.merge_rate,
            "outer_lr": rule.outer_lr,
            "outer_momentum": rule.outer_momentum,
            "outer_momentum_every": rule.outer_momentum_every,
            "max_trust_ratio": rule.max_trust_ratio,
            "overlap": self.delta.overlap,
            "exchanges": self.exchanges,
            "discarded_exchanges": self.discarded_exchanges,
        }

    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        return {"inner": self.inner, "settings": self._settings()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled wrapper has a detached exchange: it is not attached to the original's PS."""
        settings = dict(state["settings"])
        counts = (int(settings.pop("exchanges", 0)), int(settings.pop("discarded_exchanges", 0)))
        sync_every = check_sync_period(settings.pop("sync_every", 4))
        overlap = check_overlap(settings.pop("overlap", False))
        self._setup(state["inner"], sync_every, OuterRule(**settings), counts, overlap)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the wrapper's settings and counters under :attr:`state_key`."""
        sd = self.inner.state_dict()
        sd[self.state_key] = self._settings()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner state and the counters; the settings and the PS wiring stay this wrapper's."""
        sd = dict(state_dict)
        extra = sd.pop(self.state_key, None) or {}
        self.inner.load_state_dict(sd)
        self.delta.exchanges = int(extra.get("exchanges", 0))
        self.delta.discarded = int(extra.get("discarded_exchanges", 0))

    def __repr__(self) -> str:
        extra = ", overlap=True" if self.delta.overlap else ""
        return (
            f"{type(self).__name__}({self.inner!r}, sync_every={self.period.setting!r}, rule={self.delta.rule!r}"
            f"{extra})"
        )
