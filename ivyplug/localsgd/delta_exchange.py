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

With ``PSConfig.wire_dtype="bfloat16"`` a delta travels in bf16 with error feedback (to a shard in process, or in
shared memory in a job across hosts, the rounded delta travels as fp32: it is rounded before it is cut into
shards): the worker rounds ``e + Δ`` to bf16 itself (``e``: what rounding left out of the previous deltas), pushes
that, and keeps ``e ← e + Δ − bf16(e + Δ)``. The deltas applied then sum to the true deltas' sum less the last
``e``, which is at most half a bf16 unit of the last pushed delta per element: nothing is lost over time. ``e``
restarts at zero after a dropped (non-finite) delta; it is not part of a checkpoint (it is below one bf16
rounding).

Overlapped exchange (``overlap=True``, docs/design.md "Overlapped exchange"): the push and the pull run on a
background thread while the worker keeps taking local steps on its model; at most one exchange is in flight.
The PSClient is started over *shadow* copies of the parameters and buffers (:meth:`DeltaExchange.ps_tensors`),
so the thread never touches the model. At an exchange point, with x the model's parameters and s the snapshot:

1. wait for the exchange in flight (``PSConfig.timeout``), and apply it: with g the pulled global copy and
   x_sent the parameters it pushed from, ``x ← g + (x − x_sent)`` and ``s ← g`` (buffers likewise:
   ``b ← b_pulled + (b − b_sent)``);
2. push ``s − x`` (every local step since the last push, each pushed exactly once) in the background and
   remember ``x_sent ← x``.

The steps taken while an exchange is in flight started from a point that did not include its merge: one
exchange of delay, as in Streaming DiLoCo's overlapped outer step. A dropped (non-finite) delta restarts the
worker from the global copy, the steps taken meanwhile included. An error of the thread is raised in the
training thread by the first local step after it ended (:meth:`DeltaExchange.raise_failed`), or by the next
exchange point or :meth:`DeltaExchange.finish`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ivyplug.localsgd.sync_period import SyncPeriod
    from ivyplug.ps.worker.client import PSClient

log = logging.getLogger(__name__)


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
        >>> from ivyplug.localsgd.delta_exchange import OuterRule
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
                from ivyplug.localsgd.outer import DelayedNesterov

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


def check_overlap(value: object) -> bool:
    """A bool (ValueError naming ``overlap`` otherwise)."""
    if not isinstance(value, bool):
        raise ValueError(f"overlap must be True or False, got {value!r}")
    return value


def check_overlap_mode(overlap: bool, mode: str) -> None:
    """Refuse ``overlap=True`` in ssp mode (ValueError naming both), before any process group or server starts."""
    if overlap and mode == "ssp":
        raise ValueError(
            "overlap=True runs in mode='sync' or 'async': in ssp a push in flight may wait on the clock for a "
            "worker that waits for this one's batches; use overlap=False with ssp"
        )


def _pairs(items: Sequence[Any], what: str) -> list[tuple[str | None, Tensor]]:
    out: list[tuple[str | None, Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, Tensor):
            out.append((None, item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor):
            out.append((str(item[0]), item[1]))
        else:
            raise ValueError(f"{what} must be tensors or (name, tensor) pairs, got {type(item).__name__} at {i}")
    return out


class _InFlight:
    """One exchange running on its background thread (see the module docstring, "Overlapped exchange")."""

    def __init__(self, sent: list[Tensor], buffers_sent: list[Tensor]) -> None:
        self.sent = sent  # the parameters the pushed delta was measured at
        self.buffers_sent = buffers_sent
        self.dropped = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.seconds = 0.0  # the push and pull's whole time on the background thread


class DeltaExchange:
    """Measures a worker's progress since its last pull and exchanges it through a :class:`PSClient`.

    ``overlap=True``: the exchange runs in the background (:meth:`start`, :meth:`finish`; the module docstring
    states the rule); the PSClient must then be started over :meth:`ps_tensors`.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        merge_rate: float | None = None,
        rule: OuterRule | None = None,
        *,
        error_feedback: bool = True,
        overlap: bool = False,
    ) -> None:
        self.params = list(params)
        self.overlap = check_overlap(overlap)
        # overlap: id(model tensor) -> (model tensor, its shadow, which the PSClient holds)
        self._shadows: dict[int, tuple[Tensor, Tensor]] = {}
        self._extra: list[tuple[Tensor, Tensor]] = []  # (model, shadow) of params the optimizer does not hold
        self._buffers: list[tuple[Tensor, Tensor]] = []  # (model buffer, shadow buffer)
        self._inflight: _InFlight | None = None
        #: overlap: seconds the training thread waited for an exchange in flight
        self.wait_seconds = 0.0
        #: overlap: the whole time (push, merge, pull) of the last exchange applied, on its background thread
        self.last_background_seconds: float | None = None
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
        check_overlap_mode(self.overlap, mode)
        params = [self._shadow(p) for p in self.params] if self.overlap else self.params
        self.outer = self.rule.build(params, mode, num_workers)
        return self.outer

    def _shadow(self, t: Tensor) -> Tensor:
        entry = self._shadows.get(id(t))
        if entry is None:
            entry = (t, t.detach().clone())
            self._shadows[id(t)] = entry
        return entry[1]

    def ps_tensors(self, params: Sequence[Any], buffers: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
        """The params and buffers to start the PSClient over: shadow copies with ``overlap``, else the same.

        Items are tensors or (name, tensor) pairs (as for ``PSClient.start``), returned in the same form. The
        shadows take the tensors' current values (the values a new PSClient starts from).
        """
        params, buffers = list(params), list(buffers)
        named_params, named_buffers = _pairs(params, "params"), _pairs(buffers, "buffers")
        if not self.overlap:
            return params, buffers
        held = {id(p) for p in self.params}
        self._extra = [(p, self._shadow(p)) for _, p in named_params if id(p) not in held]
        self._buffers = [(b, self._shadow(b)) for _, b in named_buffers]
        with torch.no_grad():
            for _, t in [*named_params, *named_buffers]:
                self._shadow(t).copy_(t)

        def out(named: list[tuple[str | None, Tensor]]) -> list[Any]:
            return [self._shadow(t) if n is None else (n, self._shadow(t)) for n, t in named]

        return out(named_params), out(named_buffers)

    def attach(self, client: PSClient) -> None:
        """Exchange through ``client``; the current values are the pulled global copy."""
        if self.outer is None or client.optimizer is not self.outer:
            raise ValueError("attach() needs a PSClient started with optimizer=outer_optimizer(mode, num_workers)")
        if self.overlap:
            held = {id(t) for _, t in client.params}
            if any(id(self._shadow(p)) not in held for p in self.params):
                raise ValueError(
                    "overlap=True: start the PSClient over ps_tensors(params, buffers) (shadow copies that the "
                    "background exchange writes), not over the model's tensors"
                )
        client.stop_early_pushes()  # local steps' backwards are not pushes: the exchange sends deltas
        self.client = client
        self.reset_snapshot()

    @torch.no_grad()
    def reset_snapshot(self) -> None:
        """Take the current values as the global copy the next delta is measured from.

        ``overlap``: first waits for an exchange in flight (not applied: call :meth:`finish` before a sync),
        then copies the shadows (the global copy last pulled) into the model's params and buffers.
        """
        if not self.overlap:
            self.snapshot = [p.detach().clone() for p in self.params]
            return
        job = self._join()
        if job is not None and job.error is not None:
            raise job.error
        for p in self.params:
            p.copy_(self._shadow(p))
        for t, shadow in [*self._extra, *self._buffers]:
            t.copy_(shadow)
        self.snapshot = [self._shadow(p).clone() for p in self.params]

    @property
    def in_flight(self) -> bool:
        """Whether an overlapped exchange is running in the background."""
        return self._inflight is not None

    def _join(self) -> _InFlight | None:
        """Wait (``PSConfig.timeout``) for the exchange in flight; returns it, no longer in flight."""
        job = self._inflight
        if job is None:
            return None
        assert job.thread is not None and self.client is not None
        timeout = self.client.cfg.timeout
        start = time.perf_counter()
        job.thread.join(timeout)
        self.wait_seconds += time.perf_counter() - start
        if job.thread.is_alive():
            from ivyplug.ps.wire.transport import PSTimeoutError

            raise PSTimeoutError(
                f"rank {self.client.rank}: the overlapped exchange did not finish within timeout={timeout:g} s "
                "(its push and pull still run in the background)"
            )
        self._inflight = None
        if job.error is not None:
            self.residual = None
            note = getattr(job.error, "add_note", None)
            if note is not None:
                note("raised by the overlapped exchange's background thread (overlap=True)")
        return job

    def raise_failed(self) -> None:
        """``overlap``: raise now what the exchange in flight raised, if its thread already ended with an error."""
        job = self._inflight
        if job is not None and job.error is not None and job.thread is not None and not job.thread.is_alive():
            failed = self._join()
            assert failed is not None and failed.error is not None
            raise failed.error

    @torch.no_grad()
    def start(self, local_steps: int) -> None:
        """``overlap``: apply the exchange in flight (:meth:`finish`), then push −Δ in the background."""
        client = self.client
        if client is None:
            raise RuntimeError("start() needs a PS: start a PSClient with outer_optimizer() and attach() it")
        if not self.overlap:
            raise RuntimeError("start() is the overlapped exchange (overlap=True); use exchange()")
        self.finish()
        pseudo = [s - p.detach() for s, p in zip(self.snapshot, self.params, strict=True)]
        if client.cfg.wire_dtype == "bfloat16":
            pseudo = self._round_bf16(pseudo)
        shadows = [self._shadow(p) for p in self.params]
        for shadow, g in zip(shadows, pseudo, strict=True):
            shadow.grad = g
        for b, shadow in self._buffers:
            shadow.copy_(b)
        job = _InFlight([p.detach().clone() for p in self.params], [b.detach().clone() for b, _ in self._buffers])
        skipped = client.metrics()["nonfinite_skipped"]
        steps = max(1, int(local_steps))

        def run() -> None:
            began = time.perf_counter()
            try:
                client.step(steps, delta=True)  # the PS checks the whole push (nonfinite policy)
                job.dropped = client.metrics()["nonfinite_skipped"] > skipped
            except BaseException as exc:  # raised in the training thread by the next finish()
                job.error = exc
            finally:
                for shadow in shadows:
                    shadow.grad = None
                job.seconds = time.perf_counter() - began

        job.thread = threading.Thread(target=run, name=f"ivyplug-exchange-rank{client.rank}", daemon=True)
        self._inflight = job
        job.thread.start()

    @torch.no_grad()
    def finish(self) -> None:
        """``overlap``: wait for the exchange in flight, if any, and continue from its pull plus the steps
        taken meanwhile (``x ← g + (x − x_sent)``, ``snapshot ← g``); raises what its thread raised."""
        job = self._join()
        if job is None:
            return
        if job.error is not None:
            raise job.error
        self.exchanges += 1
        self.last_background_seconds = job.seconds
        if job.dropped:  # nothing of it was applied: restart from the global copy, like exchange()
            self.discarded += 1
            self.residual = None
            self.reset_snapshot()
            return
        for p, sent in zip(self.params, job.sent, strict=True):
            p.sub_(sent).add_(self._shadow(p))
        for (b, shadow), sent in zip(self._buffers, job.buffers_sent, strict=True):
            if b.dtype == torch.bool:
                b.copy_(shadow)
            else:
                b.sub_(sent).add_(shadow)
        for t, shadow in self._extra:
            t.copy_(shadow)
        self.snapshot = [self._shadow(p).clone() for p in self.params]

    def close(self) -> None:
        """Wait for an exchange in flight and drop it (teardown; its error, if any, is logged)."""
        try:
            job = self._join()
        except Exception as exc:
            log.warning("ivyplug: the overlapped exchange did not end at close: %s", exc)
            return
        if job is not None and job.error is not None:
            log.warning("ivyplug: the overlapped exchange in flight at close failed: %s", job.error)

    def timed_exchange(self, local_steps: int, period: SyncPeriod) -> None:
        """:meth:`exchange`, or with ``overlap`` :meth:`start`, timed for ``period`` (``sync_every="auto"``).

        With overlap the period counts the whole time of the exchange just applied, measured on its thread,
        not the wait it left: H then keeps that cost within the share, hidden under the local steps.
        """
        period.exchange_started()
        if not self.overlap:
            self.exchange(local_steps)
            period.exchange_ended()
            return
        applied = self.exchanges
        self.start(local_steps)
        period.exchange_ended(self.last_background_seconds if self.exchanges > applied else None)

    @torch.no_grad()
    def exchange(self, local_steps: int) -> None:
        """Push −Δ weighted by ``local_steps`` (sync mode), pull the global copy into the params, re-snapshot.

        ``overlap``: the same, waiting for it (:meth:`start` then :meth:`finish`).
        """
        client = self.client
        if client is None:
            raise RuntimeError("exchange() needs a PS: start a PSClient with outer_optimizer() and attach() it")
        if self.overlap:
            self.start(local_steps)
            self.finish()
            return
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
