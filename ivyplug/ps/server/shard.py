"""One PS shard: fp32 master parameters, the mirrored optimizer, a version counter, worker clocks.

A :class:`Shard` owns its state and the one lock that guards it; nothing else takes that lock. Its
requests (``push_pull``, ``pull``, ``idle``, ``norm``, ``state``, ``load``) are called by whoever holds the
shard: the co-located worker through an in-process endpoint, the server loop for requests that came over
the wire (endpoints.py). A reply is a future. Replies that must wait (sync: until every worker's push of
the step is applied; ssp: until the slowest live worker is within ``staleness`` steps) stay pending until
a later request makes them ready. Futures are resolved and norms are sent to the peer shards only after
the lock is released, so no network I/O ever happens under it.

Update rules (documented in docs/design.md; the mode's part is its policy, mode_policy.py):
- sync: the step's gradients are combined in worker-rank order as sum(n_w * g_w) / sum(n_w) (so the
  result does not depend on arrival order, and uneven batches are unbiased); with ``max_grad_norm`` the
  servers exchange squared shard norms and every shard scales by the global clip coefficient.
- async/ssp: each push is applied on arrival. Its staleness tau is the shard version now minus the
  version this worker last pulled (the updates it did not see); with ``staleness_scaling="inverse"`` the
  server takes that push's step with learning rate ``lr / (tau + 1)`` (every param group's ``lr``, for
  every optimizer: scaling the gradient instead would barely change the step of LAMB or Adam, whose
  step does not scale with the gradient). With W workers taking turns, tau is about W - 1, so W pushes
  move the model about as far as one synchronous step over their W batches.
- a parameter whose gradient is ``None`` on the pushing worker (async) or on every worker of the step
  (sync) is not stepped, as a local torch optimizer leaves it; where only some workers of a sync step
  have one, the others count as zeros in the weighted mean (DDP's ``find_unused_parameters=True``).
- a push flagged non-finite by its worker (which checks its whole push before sending any of it, so
  every shard sees the same flag) is dropped: no step in async/ssp, zero samples in a sync step (a sync
  step whose every push was dropped changes nothing). A non-finite value in a push *not* so flagged is a
  protocol error (nothing non-finite is ever applied).
- buffers: sync: weighted mean of the step's pushed buffers; async/ssp: running mean
  ``b += (pushed - b) / num_workers`` (equal to the pushed value with one worker); integer buffers
  (``num_batches_tracked``) travel as int64 bits and take the max. Workers replace their buffers with the
  server's on every pull.
"""

from __future__ import annotations

import math
import sys
import threading
import traceback
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

import torch

from ivyplug.ps.config import PSConfig
from ivyplug.ps.server.lent_state import LentState, Loan
from ivyplug.ps.server.mirror import OptimizerSpec
from ivyplug.ps.server.mode_policy import policy_for
from ivyplug.ps.server.split_trust import Key, SplitTrust, combines_trust
from ivyplug.ps.sharding import Piece, ShardPlan
from ivyplug.ps.wire import typed_state
from ivyplug.ps.wire.codecs import Bf16Codec, BlockCodec
from ivyplug.ps.wire.push import HYPER_PREFIX, PushFlag, decode_mask, mask_words, nonfinite_in, squared_norm
from ivyplug.ps.wire.segments import wire_segments
from ivyplug.ps.wire.transport import PSProtocolError


def piece_shape(shape: tuple[int, ...], piece: Piece) -> tuple[int, ...]:
    """Shape of a row block of a tensor of ``shape``."""
    if not shape:
        return ()
    return (piece.row_end - piece.row_start, *shape[1:])


def staleness_factor(tau: int, delta: bool, scaling: str) -> float:
    """The learning-rate factor of an async/ssp push made ``tau`` updates after its worker's pull.

    A gradient push gets 1 / (tau + 1): async takes one step per worker batch where sync takes one per
    global batch, and with W workers taking turns tau is about W - 1. A delta push (local updates) is already
    averaged by its merge rate (1/W by default), so only staleness beyond one round counts: 1 / max(1, tau).
    Measured on two Keras AsyncLAMB workers (digits, 5 epochs, 4 seeds): 0.95-0.96 validation accuracy with
    this rule, 0.88-0.99 with 1 / (tau + 1) at merge rate 1, where a fresh delta was applied whole.
    """
    if scaling != "inverse":
        return 1.0
    return 1.0 / max(1, tau) if delta else 1.0 / (tau + 1)


def int_words(words: torch.Tensor) -> torch.Tensor:
    """The int64 values whose bits ``words`` (fp32, an even count) carry."""
    return words.clone().view(torch.int64)


class Reply(NamedTuple):
    """A shard's answer to a push or pull: its params then buffers (flat fp32) and where it stands.

    ``snapshot`` is the shard's state at ``version``, lent (not copied): it stays unchanged until
    :meth:`release` (the shard's later steps write another buffer meanwhile); release it once read.
    """

    snapshot: torch.Tensor
    version: int
    staleness: int
    clock: int
    #: sync mode: squared L2 norm of this shard's part of the combined gradient (sample-weighted mean, before
    #: clipping) of the step that made ``version``; NaN in async/ssp, before the first step and after a step
    #: whose every push was dropped. Summed over shards it gives |g_big|² for the gradient noise scale.
    grad_sq: float = math.nan
    #: positions (in the shard's wire segments) of the parts the worker received straight into its tensors:
    #: ``snapshot`` does not hold them (wire/segments.py)
    placed: tuple[int, ...] = ()
    #: the shard's hold on ``snapshot`` (a view of its state, lent_state.py): :meth:`release` once it is read
    loan: Loan | None = None

    def release(self) -> None:
        """Done reading ``snapshot``: the shard may write that buffer again."""
        if self.loan is not None:
            self.loan.release()


class PushRefused(PSProtocolError):
    """A push that breaks the protocol (wrong sizes, unflagged NaN, a second push in one sync step): refused
    to its worker, while the shard goes on serving the others."""


class NormPeer(Protocol):
    """What a shard needs of another shard: sync clipping's norms, and split LAMB tensors' sums (split_trust.py)."""

    def norm(self, step: int, shard: int, sq: float) -> None: ...

    def trust_sums(self, key: Key, shard: int, values: list[float]) -> None: ...


_SyncPush = tuple[float, torch.Tensor | None, torch.Tensor | None, torch.Tensor, list[bool]]


class Shard:
    """State and update rules of one shard; thread-safe, replies as futures (see the module docstring)."""

    def __init__(
        self,
        shard: int,
        plan: ShardPlan,
        cfg: PSConfig,
        num_workers: int,
        spec: OptimizerSpec,
        init_flat: torch.Tensor,
    ) -> None:
        self.shard = shard
        self.plan = plan
        self.cfg = cfg
        self.num_workers = num_workers
        self.spec = spec
        self.pieces = plan.pieces[shard]
        self.param_pieces = [p for p in self.pieces if p.kind == "param"]
        self.buffer_pieces = [p for p in self.pieces if p.kind == "buffer"]
        self.n_param = sum(p.numel for p in self.param_pieces)
        self.n_total = plan.shard_numel(shard)
        if init_flat.numel() != self.n_total:
            raise ValueError(f"shard {shard}: initial values have {init_flat.numel()} elements, need {self.n_total}")
        # params then buffers, flat: the masters and ``buffers`` are views of it, replies lend it (lent_state.py)
        self.flat = LentState(init_flat.to(torch.float32, copy=True).contiguous())
        self._shapes = [piece_shape(plan.specs[p.index].shape, p) for p in self.param_pieces]
        self.masters: list[torch.Tensor] = []
        by_group: dict[int, list[torch.Tensor]] = {}
        self.piece_group: list[int] = []
        for p, view in zip(self.param_pieces, self._master_views(), strict=True):
            m = view.detach().requires_grad_(True)
            self.masters.append(m)
            g = spec.param_group[p.index]
            self.piece_group.append(g)
            by_group.setdefault(g, []).append(m)
        self.optimizer, self.groups = spec.build(by_group)
        #: pieces of LAMB tensors cut across shards: stepped in two halves around their sums (split_trust.py)
        self.split: SplitTrust | None = None
        if combines_trust(spec.cls) and self.optimizer is not None:
            split = SplitTrust(shard, plan, self.optimizer, self.masters, self.param_pieces, self.piece_group)
            self.split = split if split.positions else None
        self.buffers = self.flat.data[self.n_param :]
        # integer buffers' int64 bits, as word ranges of self.buffers (never touched by float arithmetic)
        self._int_ranges = [
            (p.offset - self.n_param, p.offset - self.n_param + p.numel) for p in self.buffer_pieces if not p.is_float
        ]
        self._float_ranges = plan.float_ranges(shard)
        self.bf16 = Bf16Codec(self.n_total, self._float_ranges)  # decodes bf16 pushes to fp32, encodes replies
        #: decodes int8 / int4 pushes (by bits) to fp32; their gradients are quantized, their buffers fp32
        self.block = {bits: BlockCodec(self.n_total, self.n_param, bits) for bits in (8, 4)}
        self.segments = wire_segments(self.pieces)  # how its fp32 payloads travel when split (Flag.SPLIT)
        self.num_params = plan.num_params
        self._mask_words = mask_words(self.num_params)
        self.nonfinite_skipped = [0] * num_workers
        self._peers: dict[int, NormPeer] = {}
        self._lock = threading.Lock()
        self.policy = policy_for(cfg.mode)  # what a push does, when a reply may go (mode_policy.py)
        self.version = 0
        self.clock = [0] * num_workers
        self.seen = [0] * num_workers
        self.live = [True] * num_workers
        self.error: str | None = None
        # sync step in progress
        # worker -> (samples, grads, buffers, hyper, has-gradient mask); grads/buffers None when dropped
        self._sync_pushes: dict[int, _SyncPush] = {}
        self._sync_combined: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, list[bool]] | None = None
        self._combined: torch.Tensor | None = None  # where several pushes are combined (_combined_grads)
        self._norms: dict[int, dict[int, float]] = {}
        self._grad_sq = math.nan  # the last sync step's combined-gradient squared norm (Reply.grad_sq)
        self._parked: list[tuple[int, int, Future[Reply]]] = []  # (worker, staleness, reply) not yet ready
        # filled under the lock, emptied after it is released (_flush): replies ready, norms to send
        self._ready: list[tuple[Future[Reply], Reply]] = []
        self._failed: list[Future[Reply]] = []
        self._norms_out: list[tuple[int, float]] = []
        self._sums_out: list[tuple[Key, list[float]]] = []  # split LAMB tensors' sums to send (split_trust.py)
        #: a sync step whose split LAMB pieces wait for the other shards' sums: (grads, buffers, has_grad)
        self._split_step: tuple[torch.Tensor, torch.Tensor, list[bool]] | None = None
        self._lost: dict[int, str] = {}  # worker -> why (sync: a step cannot complete without it)
        self._abort_reason: str | None = None  # why the futures in _failed fail, when not self.error

    @property
    def n_hyper(self) -> int:
        """Length of the fp64 vector every push carries (prefix, has-gradient mask, hyperparameters)."""
        return HYPER_PREFIX + self._mask_words + self.spec.num_values

    def connect_peers(self, peers: Mapping[int, NormPeer]) -> None:
        """The other shards of the plan (shard index -> endpoint), for the sync-mode norm exchange."""
        self._peers = {s: p for s, p in peers.items() if s != self.shard}

    # -- requests ----------------------------------------------------------------------------------
    def push_pull(self, worker: int, data: torch.Tensor, hyper: torch.Tensor) -> Future[Reply]:
        """Take ``worker``'s push; the reply is its pull once the mode allows (at once in async).

        ``data`` and ``hyper`` are read, not copied: they must stay unchanged until the reply is resolved (a
        sync step keeps them until its last push arrives). Every caller passes buffers that only the reply
        frees: the worker's packed push or its shared region, or the server loop's receive buffer for that
        worker, which takes that worker's next request only after it has read this reply.
        """
        fut: Future[Reply] = Future()
        with self._lock:
            try:
                self._check_error()
                tau = self._push(worker, data, hyper)
                self._parked.append((worker, tau, fut))
                self._release()
            except PushRefused as exc:
                fut.set_exception(exc)
                if self.policy.needs_every_worker and not self._lost:  # the step cannot complete without it
                    self._abort_step(f"worker {worker}'s push was refused ({exc})")
            except BaseException as exc:
                self._fail_locked(exc)
                fut.set_exception(exc)
        self._flush()
        return fut

    def pull(self, worker: int) -> Future[Reply]:
        """The current params and buffers (marks them as seen by ``worker``, for its staleness)."""
        fut: Future[Reply] = Future()
        with self._lock:
            try:
                self._check_error()
                self._ready.append((fut, self._snapshot(worker, 0)))
            except BaseException as exc:
                fut.set_exception(exc)
        self._flush()
        return fut

    def idle(self, worker: int) -> None:
        """``worker`` stops counting for SSP until its next push (epoch end, ``sync()``, goodbye)."""
        with self._lock:
            self.live[worker] = False
            self._release()
        self._flush()

    def join(self, worker: int) -> None:
        """``worker`` (a slot of an ``ivyplug serve`` job) starts or restarts: it sees the current version,
        and counts for SSP from its first push, at the clock of the slowest live worker (sync: the version)."""
        with self._lock:
            self._lost.pop(worker, None)
            self.clock[worker] = self.policy.join_clock(self)
            self.seen[worker] = self.version
            self.live[worker] = False
            self._sync_pushes.pop(worker, None)
            if self.split is not None:  # a push of its last life that never reached every shard cannot finish
                self.split.forget(worker)

    def _abort_step(self, why: str) -> None:
        """Fail the sync step in progress (lock held): its parked replies get ``why``, clocks restart."""
        self._failed += [fut for _, _, fut in self._parked]
        self._parked = []
        self._sync_pushes = {}
        self._sync_combined = None
        self._split_step = None
        if self.split is not None:
            self.split.forget()
        self.clock = [self.version] * self.num_workers  # the aborted step did not happen
        self._abort_reason = why

    def leave(self, worker: int, reason: str | None = None) -> None:
        """``worker`` left (``reason=None``) or is gone (``reason`` says how). Async/ssp go on without it (SSP
        stops counting it); in sync mode a step needs every worker, so the step in progress and every later
        one fail with ``reason`` until the slot is joined again."""
        with self._lock:
            self.live[worker] = False
            self._parked = [entry for entry in self._parked if entry[0] != worker]
            if reason is not None and self.policy.needs_every_worker:
                self._lost[worker] = reason
                self._abort_step(f"worker {worker} is gone: {reason}")
            self._release()
        self._flush()

    def norm(self, step: int, shard: int, sq: float) -> None:
        """Another shard's squared norm of sync step ``step``'s combined gradient (for global clipping)."""
        with self._lock:
            try:
                self._note_norm(step, shard, sq)
            except BaseException as exc:
                self._fail_locked(exc)
        self._flush()

    def trust_sums(self, key: Key, shard: int, values: list[float]) -> None:
        """Another shard's sums of squares of its pieces of split LAMB tensors for update ``key`` (split_trust.py)."""
        with self._lock:
            try:
                if self.split is None:
                    raise PSProtocolError(f"shard {self.shard} holds no split LAMB tensor, but shard {shard} sent sums")
                self.split.note_values(key, shard, values)
                self._try_finish_split()
            except BaseException as exc:
                self._fail_locked(exc)
        self._flush()

    def fail(self, exc: BaseException) -> None:
        """Mark the shard failed: every pending and later request gets an error naming ``exc``."""
        with self._lock:
            self._fail_locked(exc)
        self._flush()

    def describe_wait(self, worker: int, timeout: float) -> str:
        """What ``worker``'s pending reply waits for (the text of a timeout error)."""
        with self._lock:
            return self._waiting_for(worker, timeout)

    def versions(self) -> tuple[int, list[int]]:
        """The shard version and every worker's clock (a consistent copy)."""
        with self._lock:
            return self.version, list(self.clock)

    def _flush(self) -> None:
        """Resolve ready replies and send norms, outside the lock (callbacks may do network I/O)."""
        with self._lock:
            ready, self._ready = self._ready, []
            failed, self._failed = self._failed, []
            norms, self._norms_out = self._norms_out, []
            sums, self._sums_out = self._sums_out, []
            error = self._abort_reason or f"failed: {self.error}"
            self._abort_reason = None
        for fut in failed:  # pending replies fail now (their requesters hear it), not after a timeout
            if not fut.done():
                fut.set_exception(PSProtocolError(f"PS shard {self.shard}: {error}"))
        for step, sq in norms:
            for peer in self._peers.values():
                peer.norm(step, self.shard, sq)
        for key, values in sums:
            assert self.split is not None
            for s in self.split.peers:
                self._peers[s].trust_sums(key, self.shard, values)
        for fut, reply in ready:
            if not fut.done():
                fut.set_result(reply)

    # -- update rules (call with self._lock held) ----------------------------------------------
    def _apply_hyper(self, hyper: torch.Tensor) -> None:
        if self.optimizer is not None:
            self.spec.decode_into(hyper[HYPER_PREFIX + self._mask_words :], self.groups)

    def _has_grad(self, hyper: torch.Tensor) -> list[bool]:
        """Per parameter index of the plan: whether the pushing worker had a gradient for it."""
        return decode_mask(hyper[HYPER_PREFIX : HYPER_PREFIX + self._mask_words].tolist(), self.num_params)

    def _step(self, grads: torch.Tensor, has_grad: list[bool], lr_scale: float = 1.0) -> None:
        """Apply one optimizer step with ``grads`` (flat fp32 over this shard's params).

        Parameters without a gradient (``has_grad``) get ``grad = None``, so the optimizer leaves them
        (and their state) alone. ``lr_scale`` multiplies every group's learning rate for this step only.
        """
        if self.optimizer is not None:
            self._writable()
            for m, p, g in zip(self.masters, self.param_pieces, self.piece_group, strict=True):
                has = g >= 0 and has_grad[p.index]
                m.grad = grads[p.offset : p.offset + p.numel].view(m.shape) if has else None
            saved = [group.get("lr") for group in self.optimizer.param_groups]
            if lr_scale != 1.0:
                for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    group["lr"] = lr * lr_scale
            try:
                with torch.no_grad():
                    self.optimizer.step()
            finally:
                if lr_scale != 1.0:
                    for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                        group["lr"] = lr
                for m in self.masters:
                    m.grad = None
        self.version += 1

    def _check_finite(self, worker: int, data: torch.Tensor) -> None:
        """A push not flagged non-finite must be finite: nothing non-finite reaches the masters."""
        at = nonfinite_in(data, self._float_ranges)
        if at is None:
            return
        piece = next(p for p in self.pieces if p.offset <= at < p.offset + p.numel)
        raise PushRefused(
            f"shard {self.shard}: push {self.clock[worker] + 1} of worker {worker} holds non-finite values in "
            f"{self.plan.specs[piece.index].name!r} but was not flagged so (a PS client must check its whole push "
            "first); nothing of it was applied"
        )

    def _push(self, worker: int, data: torch.Tensor, hyper: torch.Tensor) -> int:
        """Take one push (``data`` = grads then buffers, fp32); returns the staleness assigned to it."""
        if self._lost and self.policy.needs_every_worker:
            raise PushRefused(
                f"shard {self.shard}: a sync step needs every worker, and "
                + "; ".join(f"worker {w} is gone ({why})" for w, why in sorted(self._lost.items()))
            )
        if data.numel() != self.n_total:
            raise PushRefused(
                f"shard {self.shard}: push from worker {worker} has {data.numel()} values, expected {self.n_total}"
            )
        n_expected = HYPER_PREFIX + self._mask_words + self.spec.num_values
        if hyper.numel() != n_expected:
            raise PushRefused(f"shard {self.shard}: push has {hyper.numel()} hyperparameters, expected {n_expected}")
        self.live[worker] = True
        skipped = bool(int(hyper[2]) & PushFlag.NONFINITE)
        if skipped:
            self.nonfinite_skipped[worker] += 1
        else:
            self._check_finite(worker, data)
        return self.policy.take(self, worker, data[: self.n_param], data[self.n_param :], hyper, skipped)

    def hold_sync_push(
        self, worker: int, grads: torch.Tensor, bufs: torch.Tensor, hyper: torch.Tensor, skipped: bool
    ) -> None:
        """Sync: keep ``worker``'s push of the step in progress; the last one in combines the step."""
        if worker in self._sync_pushes:
            raise PushRefused(f"shard {self.shard}: worker {worker} pushed twice in step {self.version}")
        num_samples = 0.0 if skipped else float(hyper[1])
        kept = (None, None) if skipped else (grads, bufs)  # not copied: see push_pull
        self._sync_pushes[worker] = (num_samples, *kept, hyper, self._has_grad(hyper))
        self.clock[worker] += 1
        if len(self._sync_pushes) == self.num_workers:
            self._combine_sync()

    def apply_push(
        self, worker: int, grads: torch.Tensor, bufs: torch.Tensor, hyper: torch.Tensor, skipped: bool
    ) -> int:
        """Async/ssp: step with ``worker``'s push now, scaled for its staleness; returns the staleness."""
        tau = self.version - self.seen[worker]
        if not skipped:
            self._apply_hyper(hyper)
            scale = staleness_factor(tau, bool(int(hyper[2]) & PushFlag.DELTA), self.cfg.staleness_scaling)
            has_grad = self._has_grad(hyper)
            if self._begin_split((worker, int(hyper[3])), grads, has_grad, scale):  # its reply waits for the rest
                has_grad = self._unsplit(has_grad)
            self._step(grads, has_grad, lr_scale=scale)
            self._merge_buffers_async(bufs)
            self._try_finish_split()  # tensors split only among this shard's own pieces
        self.clock[worker] += 1  # push_pull releases the replies this allows, this push's own included
        return tau

    def _merge_ints(self, out: torch.Tensor, pushed: list[torch.Tensor]) -> None:
        """Integer buffers in ``out`` (buffer words) become the max over ``pushed``, exactly (int64)."""
        for a, b in self._int_ranges:
            best = int_words(pushed[0][a:b])
            for other in pushed[1:]:
                best = torch.maximum(best, int_words(other[a:b]))
            out[a:b] = best.view(torch.float32)

    def _merge_buffers_async(self, bufs: torch.Tensor) -> None:
        if bufs.numel() == 0:
            return
        self._writable()
        if self.num_workers == 1:
            self.buffers.copy_(bufs)
            return
        current = self.buffers.clone() if self._int_ranges else self.buffers
        self.buffers.add_(bufs - self.buffers, alpha=1.0 / self.num_workers)
        self._merge_ints(self.buffers, [current, bufs])

    def _combine_sync(self) -> None:
        order = sorted(self._sync_pushes)
        hyper = self._sync_pushes[order[0]][3]  # the lowest rank's hyperparameters: independent of arrival order
        counted = [w for w in order if self._sync_pushes[w][0] > 0]
        total = sum(self._sync_pushes[w][0] for w in counted)
        if not counted:  # every push of the step was dropped (non-finite): the step changes nothing
            self._sync_pushes = {}
            self._grad_sq = math.nan
            self.version += 1
            self._release()
            return
        has_grad = [any(self._sync_pushes[w][4][i] for w in counted) for i in range(self.num_params)]
        if len(counted) == 1:
            grads, bufs = self._sync_pushes[counted[0]][1], self._sync_pushes[counted[0]][2]
            assert grads is not None and bufs is not None
        else:
            grads = self._combined_grads()
            acc = torch.zeros(self.n_total - self.n_param, dtype=torch.float64)
            pushed = []
            for i, w in enumerate(counted):
                n, g, b, _, _ = self._sync_pushes[w]
                assert g is not None and b is not None
                if i == 0:  # n * g, as 0 + n * g would give it, without zeroing the buffer first
                    torch.mul(g, n, out=grads)
                else:
                    grads.add_(g, alpha=n)  # a worker without a gradient for a param pushed zeros there
                acc.add_(b.double(), alpha=n)
                pushed.append(b)
            grads.div_(total)
            bufs = (acc / total).to(torch.float32)
            self._merge_ints(bufs, pushed)
        max_norm = float(hyper[0])
        self._sync_pushes = {}
        self._sync_combined = (grads, bufs, hyper, max_norm, has_grad)  # hyper[4]: the clip value, below
        # one float64 pass: the clipping norm, and |g_big|² that workers read for the gradient noise scale
        sq = squared_norm(grads)
        self._grad_sq = sq
        if max_norm >= 0:
            self._note_norm(self.version, self.shard, sq)
            if set(self.plan.nonempty_shards()) - {self.shard}:
                self._norms_out.append((self.version, sq))
        self._try_apply_sync()

    def _combined_grads(self) -> torch.Tensor:
        """The buffer a sync step's combined gradient is written to, allocated once: one step is combined and
        applied before the next can start (every worker's push is needed), and a fresh multi-MB tensor per
        step costs a page fault per 4 KiB on first touch."""
        if self._combined is None:
            self._combined = torch.empty(self.n_param, dtype=torch.float32)
        return self._combined

    def _note_norm(self, step: int, shard: int, sq: float) -> None:
        self._norms.setdefault(step, {})[shard] = sq
        if shard != self.shard:
            self._try_apply_sync()

    def _try_apply_sync(self) -> None:
        if self._sync_combined is None:
            return
        grads, bufs, hyper, max_norm, has_grad = self._sync_combined
        if max_norm >= 0:
            norms = self._norms.get(self.version, {})
            needed = self.plan.nonempty_shards()
            if any(s not in norms for s in needed):
                return
            total_norm = math.sqrt(sum(norms[s] for s in needed))
            coef = torch.tensor(max_norm / (total_norm + 1e-6), dtype=torch.float32).clamp(max=1.0)
            grads = grads * coef
            del self._norms[self.version]
        clip_value = float(hyper[4])
        if clip_value >= 0:  # element-wise: each shard clamps its own part of the combined gradient
            grads = grads.clamp(-clip_value, clip_value)
        self._sync_combined = None
        self._apply_hyper(hyper)
        if self._begin_split((-1, self.version), grads, has_grad):
            self._split_step = (grads, bufs, has_grad)
            self._try_finish_split()
            return
        self._finish_sync(grads, bufs, has_grad)

    def _begin_split(self, key: Key, grads: torch.Tensor, has_grad: list[bool], lr_scale: float = 1.0) -> bool:
        """First half of update ``key`` of the split LAMB pieces (its sums go to the peers); whether one began."""
        if self.split is None:
            return False
        sums = self.split.begin(key, grads, has_grad, lr_scale)
        if sums is None:
            return False
        self._sums_out.append((key, sums))
        return True

    def _unsplit(self, has_grad: list[bool]) -> list[bool]:
        """``has_grad`` without the split LAMB tensors (the optimizer's step leaves them to split_trust.py)."""
        split = set(self.split.tensors) if self.split is not None else set()
        return [has and t not in split for t, has in enumerate(has_grad)]

    def _try_finish_split(self) -> None:
        """Second halves of the updates of split LAMB pieces whose every sum is in; releases the replies they held."""
        if self.split is None:
            return
        ready = self.split.ready()
        if not ready:
            return
        self._writable()
        for key in ready:
            self.split.finish(key)
        if self._split_step is not None and (-1, self.version) in ready:  # sync: the rest of the step
            grads, bufs, has_grad = self._split_step
            self._split_step = None
            self._finish_sync(grads, bufs, self._unsplit(has_grad))
        else:
            self._release()

    def _finish_sync(self, grads: torch.Tensor, bufs: torch.Tensor, has_grad: list[bool]) -> None:
        self._step(grads, has_grad)
        if bufs.numel():
            self._writable()
            self.buffers.copy_(bufs)
        self._release()

    # -- readiness, snapshots, parked replies ---------------------------------------------------
    def min_live_clock(self) -> int:
        live = [c for c, ok in zip(self.clock, self.live, strict=True) if ok]
        return min(live) if live else max(self.clock)

    def _is_ready(self, worker: int) -> bool:
        """Whether ``worker``'s reply after its push may go out now (the consistency mode's rule, once the split
        LAMB pieces of its push stepped)."""
        return self.policy.is_ready(self, worker) and not (self.split is not None and self.split.waits(worker))

    def _snapshot(self, worker: int, staleness: int) -> Reply:
        """The state (params then buffers, flat fp32) lent to the reply; marks what ``worker`` has seen."""
        data, loan = self.flat.lend()
        self.seen[worker] = self.version
        return Reply(data, self.version, staleness, self.clock[worker], self._grad_sq, loan=loan)

    def _master_views(self) -> list[torch.Tensor]:
        """Each param piece's place in the current state buffer, in its shape."""
        flat = self.flat.data
        pieces = zip(self.param_pieces, self._shapes, strict=True)
        return [flat[p.offset : p.offset + p.numel].view(shape) for p, shape in pieces]

    def _writable(self) -> None:
        """Call before every write of masters or buffers: a state lent to a reply moves to a free buffer."""
        if not self.flat.writable():
            return
        for m, view in zip(self.masters, self._master_views(), strict=True):
            m.data = view
        self.buffers = self.flat.data[self.n_param :]

    def _release(self) -> None:
        """Move the pending replies the mode now allows to ``_ready`` (snapshots taken under the lock)."""
        keep = []
        for worker, staleness, fut in self._parked:
            if self._is_ready(worker):
                self._ready.append((fut, self._snapshot(worker, staleness)))
            else:
                keep.append((worker, staleness, fut))
        self._parked = keep

    def _waiting_for(self, worker: int, timeout: float) -> str:
        what = self.policy.waiting_for(self)
        return f"timed out after {timeout:g} s on shard {self.shard} (worker {worker}) waiting for {what}"

    def sync_wait(self) -> str:
        """Sync: what the step in progress waits for (pushes, or the other shards' gradient norms or sums)."""
        if self._split_step is not None and self.split is not None:
            return (
                f"the trust-ratio sums of step {self.version}'s split LAMB tensors from shard(s) "
                f"{self.split.missing((-1, self.version))}"
            )
        missing = sorted(set(range(self.num_workers)) - set(self._sync_pushes))
        if self._sync_combined is None:
            return f"the pushes of step {self.version} from worker(s) {missing}"
        got = self._norms.get(self.version, {})
        return f"gradient norms of step {self.version} from shard(s) " + str(
            sorted(set(self.plan.nonempty_shards()) - set(got))
        )

    def _check_error(self) -> None:
        if self.error is not None:
            raise PSProtocolError(f"PS shard {self.shard} failed earlier: {self.error}")

    def _fail_locked(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
            # the failure's own traceback: one handed in from elsewhere (a worker's abort) is not being handled here
            text = "".join(traceback.format_exception(exc)).rstrip()
            print(f"[ivyplug.ps] shard {self.shard} error:\n{text}", file=sys.stderr, flush=True)
        self._failed += [fut for _, _, fut in self._parked]
        self._parked = []

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> bytes:
        """This shard's full state in the typed encoding (wire/typed_state.py: no pickle on either side)."""
        with self._lock:
            state = {
                "shard": self.shard,
                "version": self.version,
                "clock": list(self.clock),
                "seen": list(self.seen),
                "params": [m.detach().clone() for m in self.masters],
                "buffers": self.buffers.clone(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            }
        return typed_state.encode(state)

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_bytes` output. ``state["reset_clocks"]``: the state was written in another
        mode or by another number of workers, whose clocks mean something else (async clocks count each worker's
        pushes, sync clocks equal the version): every worker restarts at the saved version, as after a sync step."""
        with self._lock:
            if state["shard"] != self.shard or len(state["params"]) != len(self.masters):
                raise ValueError(f"state of shard {state['shard']} does not fit shard {self.shard} of this plan")
            if len(state["clock"]) != self.num_workers and not state.get("reset_clocks"):
                raise ValueError(
                    f"checkpoint was written by {len(state['clock'])} workers, this job has {self.num_workers}"
                )
            for m, t in zip(self.masters, state["params"], strict=True):
                if tuple(m.shape) != tuple(t.shape):
                    raise ValueError(
                        f"shard {self.shard}: checkpoint tensor shape {tuple(t.shape)} != {tuple(m.shape)}"
                    )
            self._writable()
            with torch.no_grad():
                for m, t in zip(self.masters, state["params"], strict=True):
                    m.copy_(t)
            self.buffers.copy_(state["buffers"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
                # torch's load_state_dict builds new param-group dicts: re-point the user-group map at them,
                # or the hyperparameters carried by later pushes (LR schedulers) would update stale dicts.
                self.groups = {g: self.optimizer.param_groups[i] for i, g in enumerate(sorted(self.groups))}
            if self.split is not None:  # the updates in progress were the replaced state's
                self.split.forget()
            self._split_step = None
            self.version = int(state["version"])
            if state.get("reset_clocks"):
                self.clock = [self.version] * self.num_workers
                self.seen = [self.version] * self.num_workers
            else:
                self.clock = [int(c) for c in state["clock"]]
                self.seen = [int(c) for c in state["seen"]]
            self._sync_pushes = {}
            self._sync_combined = None
            self._norms = {}


def load_state_bytes(blob: bytes) -> dict[str, Any]:
    """Inverse of :meth:`Shard.state` (tensors and plain containers only: nothing is unpickled)."""
    state = typed_state.decode(blob)
    if not isinstance(state, dict):
        raise ValueError(f"a shard state is a dict, got {type(state).__name__}")
    return state
