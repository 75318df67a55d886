"""Delta averaging through the PS: push x_local − x_pulled, let the servers merge it, continue from the pull.

The merge runs on the existing PS machinery: the servers mirror an *outer* optimizer, plain SGD with
``lr = merge_rate``, and the worker pushes the pseudo-gradient x_pulled − x_local (= −Δ), so the servers
apply ``x ← x + merge_rate · Δ``. Every PS rule then holds unchanged: sync mode combines the workers' deltas
weighted by their local step counts before one merge; async/ssp merge each delta on arrival, with the
outer rate divided by τ for a delta made τ ≥ 2 merges after its pull (``staleness_scaling="inverse"``: the
merge rate already averages over the other workers' deltas of a round, see ``shard.staleness_factor``);
buffers follow the PS buffer rule at every exchange; a non-finite delta follows the PS's ``nonfinite``
policy like any push.

``merge_rate=None`` picks 1.0 in sync mode (the global copy moves by the mean delta) and 1/num_workers in
async/ssp (once every worker pushed, the global copy moved by the mean of their deltas). A delta with a
NaN/Inf is dropped whole by the PS (``nonfinite="skip"``, counted in ``discarded``; in sync mode it counts
zero local steps) or stops training (``"raise"``); either way nothing non-finite reaches the servers, and
after a drop the worker restarts from the global copy. Used by ``ivyplug.optim.LocalUpdates`` (and so
``AsyncLAMB``) and the Keras ``AsyncLAMB``.

Outer optimizers (:class:`OuterRule`, docs/design.md "Outer optimizers"): the merge above is
``outer="average"``. ``"nesterov"`` mirrors Nesterov SGD over the pseudo-gradient (DiLoCo's outer step;
with ``outer_momentum_every`` > 1 the delayed Nesterov update, :class:`ivyplug.optim.DelayedNesterov`), and
``"lamb"`` mirrors LAMB over it, whose clipped layer-wise trust ratio bounds how far one merge moves a layer.
The servers build whichever optimizer :meth:`OuterRule.build` returns, as they build any optimizer.

With ``PSConfig.wire_dtype="bfloat16"`` a delta travels in bf16 with error feedback: the worker rounds
``e + Δ`` to bf16 itself (``e``: what rounding left out of the previous deltas), pushes that, and keeps
``e ← e + Δ − bf16(e + Δ)``. The deltas applied then sum to the true deltas' sum less the last ``e``, which is
at most half a bf16 unit of the last pushed delta per element: nothing is lost over time. ``e`` restarts at
zero after a dropped (non-finite) delta; it is not part of a checkpoint (it is below one bf16 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ivyplug.ps.client import PSClient


def check_merge_rate(value: object) -> float | None:
    """``None`` or a finite number > 0 (ValueError naming ``merge_rate`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"merge_rate must be None or a finite number > 0, got {value!r}")
    return float(value)


def check_sync_every(value: object) -> int:
    """An int >= 1 (ValueError naming ``sync_every`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sync_every must be an int >= 1 (local steps between exchanges), got {value!r}")
    return value


#: The outer optimizers a delta can be merged with (:class:`OuterRule`).
OUTERS = ("average", "nesterov", "lamb")

#: ``outer_lr=None``: DiLoCo's outer learning rate for Nesterov; for LAMB, whose step moves every layer by about
#: ``outer_lr · ‖x‖`` whatever the delta's size, 4% of each layer's norm per round of merges (divided by the
#: number of workers in async/ssp, where each merge carries one worker's delta).
DEFAULT_OUTER_LR = {"nesterov": 0.7, "lamb": 0.04}

#: ``outer_momentum=None``: Nesterov's β and LAMB's β1. Along a steady pseudo-gradient g Nesterov's step
#: converges to ``outer_lr / (1 − β) · g``: DiLoCo's 0.7 with β = 0.9 is 7× the mean delta per round, made for
#: hundreds of local steps per round, where much of a delta is noise that the next rounds cancel; with tens of
#: local steps of an inner optimizer tuned for data-parallel training it overshoots (H = 16 on the digits MLP:
#: 1.7-2.2 points below DDP, see docs/benchmarks.md). β = 0.5 keeps DiLoCo's outer lr at 1.4× the mean delta
#: and a momentum memory of about two rounds, short against the tens of rounds of such a fit.
DEFAULT_OUTER_MOMENTUM = {"nesterov": 0.5, "lamb": 0.9}

#: LAMB's second-moment decay and ε for ``outer="lamb"`` (β1 is ``outer_momentum``).
OUTER_LAMB_BETA2 = 0.999
OUTER_LAMB_EPS = 1e-6


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class OuterRule:
    """How the servers merge a pushed delta Δ: the outer optimizer they step with the pseudo-gradient g = −Δ.

    The formulas are in docs/design.md ("Outer optimizers"). ``None`` values pick per consistency mode in
    :meth:`build`; a number is used as given. Every value is checked here (ValueError naming it).

    Args:
        outer: ``"average"`` (SGD with lr ``merge_rate``: ``x ← x + merge_rate · Δ``), ``"nesterov"``
            (Nesterov SGD, DiLoCo's outer step) or ``"lamb"`` (LAMB with a clipped layer-wise trust ratio).
        merge_rate: ``"average"`` only; ``None``: 1.0 in sync mode, 1/num_workers in async/ssp.
        outer_lr: ``"nesterov"``/``"lamb"`` only; ``None``: 0.7 for nesterov, 0.04 for lamb in sync mode and
            0.04/num_workers in async/ssp.
        outer_momentum: Nesterov's β, LAMB's β1 (β2 = 0.999), in [0, 1); ``None``: 0.5 for nesterov (its
            steady step ``outer_lr / (1 − β)`` is then 1.4× the mean delta), 0.9 for lamb.
        outer_momentum_every: ``"nesterov"`` only: N, merges per momentum update (delayed Nesterov, see
            :class:`ivyplug.optim.DelayedNesterov`); ``None``: 1 in sync mode, num_workers in async/ssp.
        max_trust_ratio: ``"lamb"`` only: the upper clip of the trust ratio (> 0, ``inf`` allowed).

    Example:
        >>> import torch
        >>> from ivyplug.ps.delta_exchange import OuterRule
        >>> rule = OuterRule("nesterov")
        >>> type(rule.build([torch.zeros(3)], "async", 4)).__name__  # momentum once per 4 merges
        'DelayedNesterov'
        >>> rule.build([torch.zeros(3)], "sync", 4).defaults["nesterov"]  # one merge per round: torch's SGD
        True
        >>> rule.build([torch.zeros(3)], "sync", 4).defaults["momentum"]  # outer_momentum=None: 0.5 for nesterov
        0.5
    """

    outer: str = "average"
    merge_rate: float | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_momentum_every: int | None = None
    max_trust_ratio: float = 10.0

    def __post_init__(self) -> None:
        if self.outer not in OUTERS:
            raise ValueError(f"outer must be 'average', 'nesterov' or 'lamb', got {self.outer!r}")
        object.__setattr__(self, "merge_rate", check_merge_rate(self.merge_rate))
        lr = self.outer_lr
        if lr is not None and (not _is_number(lr) or not math.isfinite(lr) or lr <= 0):
            raise ValueError(f"outer_lr must be None or a finite number > 0, got {lr!r}")
        beta = self.outer_momentum
        if beta is not None and (not _is_number(beta) or not 0.0 <= beta < 1.0):
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {beta!r}")
        every = self.outer_momentum_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"outer_momentum_every must be None or an int >= 1, got {every!r}")
        mtr = self.max_trust_ratio
        if not _is_number(mtr) or not mtr > 0:
            raise ValueError(f"max_trust_ratio must be a number > 0 (inf allowed), got {mtr!r}")
        if self.merge_rate is not None and self.outer != "average":
            raise ValueError(
                f"merge_rate applies to outer='average' only (got outer={self.outer!r}, whose step size is outer_lr)"
            )
        if lr is not None and self.outer == "average":
            raise ValueError("outer_lr applies to outer='nesterov' or 'lamb'; outer='average' merges with merge_rate")
        if every is not None and self.outer != "nesterov":
            raise ValueError(f"outer_momentum_every applies to outer='nesterov' only (got outer={self.outer!r})")
        object.__setattr__(self, "outer_lr", None if lr is None else float(lr))
        object.__setattr__(self, "outer_momentum", None if beta is None else float(beta))
        object.__setattr__(self, "max_trust_ratio", float(mtr))

    def build(self, params: Sequence[Tensor], mode: str, num_workers: int) -> torch.optim.Optimizer:
        """The outer optimizer over ``params`` for ``mode`` with ``num_workers`` workers (what the servers mirror)."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if mode not in ("sync", "async", "ssp"):
            raise ValueError(f"mode must be 'sync', 'async' or 'ssp', got {mode!r}")
        share = 1.0 if mode == "sync" else 1.0 / num_workers  # one merge's part of a round of W merges
        params = list(params)
        if self.outer == "average":
            rate = self.merge_rate if self.merge_rate is not None else share
            return torch.optim.SGD(params, lr=rate)
        beta = self.outer_momentum if self.outer_momentum is not None else DEFAULT_OUTER_MOMENTUM[self.outer]
        if self.outer == "nesterov":
            lr = self.outer_lr if self.outer_lr is not None else DEFAULT_OUTER_LR["nesterov"]
            every = self.outer_momentum_every
            if every is None:
                every = 1 if mode == "sync" else num_workers
            if every > 1:
                from ivyplug.optim.outer import DelayedNesterov

                return DelayedNesterov(params, lr=lr, momentum=beta, momentum_every=every)
            if beta == 0.0:  # torch refuses nesterov=True without momentum; the step is the same plain SGD
                return torch.optim.SGD(params, lr=lr)
            return torch.optim.SGD(params, lr=lr, momentum=beta, nesterov=True)
        from ivyplug.optim.optimizer import LAMB

        lr = self.outer_lr if self.outer_lr is not None else DEFAULT_OUTER_LR["lamb"] * share
        return LAMB(
            params,
            lr=lr,
            betas=(beta, OUTER_LAMB_BETA2),
            eps=OUTER_LAMB_EPS,
            weight_decay=0.0,
            bias_correction=True,
            max_trust_ratio=self.max_trust_ratio,
            min_trust_ratio=0.0,
        )


class DeltaExchange:
    """Measures a worker's progress since its last pull and exchanges it through a :class:`PSClient`."""

    def __init__(
        self,
        params: Sequence[Tensor],
        merge_rate: float | None = None,
        rule: OuterRule | None = None,
        *,
        error_feedback: bool = True,
    ) -> None:
        self.params = list(params)
        #: bf16 wire only: carry each delta's rounding error into the next one (False: plain rounding)
        self.error_feedback = error_feedback
        self.residual: list[Tensor] | None = None
        merge_rate = check_merge_rate(merge_rate)
        if rule is None:
            rule = OuterRule(merge_rate=merge_rate)
        elif merge_rate is not None and merge_rate != rule.merge_rate:
            raise ValueError(f"merge_rate {merge_rate!r} differs from the rule's {rule.merge_rate!r}")
        self.rule = rule
        self.outer: torch.optim.Optimizer | None = None
        self.client: PSClient | None = None
        self.snapshot: list[Tensor] = []
        self.exchanges = 0
        self.discarded = 0

    @property
    def merge_rate(self) -> float | None:
        """The rule's ``merge_rate`` (``outer="average"``; None otherwise or when it picks per mode)."""
        return self.rule.merge_rate

    def outer_optimizer(self, mode: str, num_workers: int, rule: OuterRule | None = None) -> torch.optim.Optimizer:
        """The optimizer the servers mirror (pass it as ``optimizer=`` to ``PSClient.start``).

        ``rule``: merge with this rule from now on (default: the one this exchange holds).
        """
        if rule is not None:
            self.rule = rule
        self.outer = self.rule.build(self.params, mode, num_workers)
        return self.outer

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client``; the current values are the pulled global copy."""
        if self.outer is None or client.optimizer is not self.outer:
            raise ValueError("attach() needs a PSClient started with optimizer=outer_optimizer(mode, num_workers)")
        client.stop_early_pushes()  # local steps' backwards are not pushes: the exchange sends deltas
        self.client = client
        self.reset_snapshot()

    def reset_snapshot(self) -> None:
        """Take the current values as the global copy the next delta is measured from."""
        self.snapshot = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def exchange(self, local_steps: int) -> None:
        """Push −Δ weighted by ``local_steps`` (sync mode), pull the global copy into the params, re-snapshot."""
        client = self.client
        if client is None:
            raise RuntimeError("exchange() needs a PS: start a PSClient with outer_optimizer() and attach() it")
        saved = [p.grad for p in self.params]
        pseudo = [s - p.detach() for s, p in zip(self.snapshot, self.params, strict=True)]
        if client.cfg.wire_dtype == "bfloat16":
            pseudo = self._round_bf16(pseudo)
        skipped = client.metrics()["nonfinite_skipped"]
        dropped = True
        try:
            for p, g in zip(self.params, pseudo, strict=True):
                p.grad = g
            client.step(max(1, int(local_steps)), delta=True)  # the PS checks the whole push (nonfinite policy)
            dropped = client.metrics()["nonfinite_skipped"] > skipped
            if dropped:
                self.discarded += 1
        finally:
            if dropped:  # nothing of it was applied; a non-finite residual would spoil every later delta
                self.residual = None
            for p, old in zip(self.params, saved, strict=True):
                p.grad = old
        self.exchanges += 1
        self.reset_snapshot()

    def _round_bf16(self, pseudo: list[Tensor]) -> list[Tensor]:
        """``pseudo`` plus the carried error, rounded to bf16 (exact on the wire); the new error is kept."""
        if not self.error_feedback:
            return [g.to(torch.bfloat16).float() for g in pseudo]
        if self.residual is None:
            self.residual = [torch.zeros_like(g) for g in pseudo]
        out = []
        for g, e in zip(pseudo, self.residual, strict=True):
            e.add_(g)  # e + (-Δ): the pseudo-gradient with what earlier roundings left out
            q = e.to(torch.bfloat16).float()
            e.sub_(q)
            out.append(q)
        return out
