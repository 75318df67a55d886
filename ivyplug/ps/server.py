"""One PS shard: fp32 master parameters, the mirrored optimizer, a version counter, worker clocks.

The shard is a state machine guarded by one condition variable. It is driven from two threads: the
co-located worker calls it directly (gloo cannot send to itself) and the server loop thread calls it
for remote requests. Replies that must wait (sync: until every worker's push of the step is applied;
ssp: until the slowest live worker is within ``staleness`` steps) are parked and sent when ready.

Update rules (documented in docs/design.md):
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

import contextlib
import io
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ivyplug.ps.config import PSConfig
from ivyplug.ps.mirror import OptimizerSpec
from ivyplug.ps.sharding import Piece, ShardPlan
from ivyplug.ps.transport import PSProtocolError, PSTimeoutError


def piece_shape(shape: tuple[int, ...], piece: Piece) -> tuple[int, ...]:
    """Shape of a row block of a tensor of ``shape``."""
    if not shape:
        return ()
    return (piece.row_end - piece.row_start, *shape[1:])


#: hyper vector layout sent with every push:
#: [max_grad_norm or -1, num_samples, push flags, *has-gradient mask words, *optimizer values]
HYPER_PREFIX = 3

#: bits of a push's has-gradient mask per fp64 word (exact: well below 53)
MASK_BITS = 32


class PushFlag:
    """Bits of the ``push flags`` entry of the hyper vector."""

    NONFINITE = 1  # the worker found a NaN/Inf in its push: every shard drops all of it


def mask_words(num_params: int) -> int:
    """fp64 words that carry the has-gradient bits of ``num_params`` parameters."""
    return (num_params + MASK_BITS - 1) // MASK_BITS


def encode_mask(has_grad: list[bool]) -> list[float]:
    """Pack per-parameter has-gradient bits into fp64-exact integers (:data:`MASK_BITS` per word)."""
    words = [0] * mask_words(len(has_grad))
    for i, has in enumerate(has_grad):
        if has:
            words[i // MASK_BITS] |= 1 << (i % MASK_BITS)
    return [float(w) for w in words]


def decode_mask(words: list[float], num_params: int) -> list[bool]:
    ints = [int(w) for w in words]
    return [bool(ints[i // MASK_BITS] >> (i % MASK_BITS) & 1) for i in range(num_params)]


def int_words(words: torch.Tensor) -> torch.Tensor:
    """The int64 values whose bits ``words`` (fp32, an even count) carry."""
    return words.clone().view(torch.int64)


def nonfinite_in(data: torch.Tensor, ranges: list[tuple[int, int]]) -> int | None:
    """Offset of the first range of ``data`` holding a NaN/Inf, else None (one pass when it is all finite)."""
    for a, b in ranges:
        if b > a and not bool(torch.isfinite(data[a:b]).all()):
            return a
    return None


_SyncPush = tuple[float, torch.Tensor | None, torch.Tensor | None, torch.Tensor, list[bool]]


class ShardServer:
    """State and update rules of one shard (thread-safe; see module docstring)."""

    def __init__(
        self,
        shard: int,
        plan: ShardPlan,
        cfg: PSConfig,
        num_workers: int,
        spec: OptimizerSpec,
        init_flat: torch.Tensor,
        send_norm: Callable[[int, float], None] | None = None,
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
        self.masters: list[torch.Tensor] = []
        by_group: dict[int, list[torch.Tensor]] = {}
        self.piece_group: list[int] = []
        for p in self.param_pieces:
            shape = piece_shape(plan.specs[p.index].shape, p)
            m = init_flat[p.offset : p.offset + p.numel].to(torch.float32).clone().view(shape).requires_grad_(True)
            self.masters.append(m)
            g = spec.param_group[p.index]
            self.piece_group.append(g)
            by_group.setdefault(g, []).append(m)
        self.optimizer, self.groups = spec.build(by_group)
        self.buffers = init_flat[self.n_param :].to(torch.float32).clone()
        # integer buffers' int64 bits, as word ranges of self.buffers (never touched by float arithmetic)
        self._int_ranges = [
            (p.offset - self.n_param, p.offset - self.n_param + p.numel) for p in self.buffer_pieces if not p.is_float
        ]
        self._float_ranges = plan.float_ranges(shard)
        self.num_params = plan.num_params
        self._mask_words = mask_words(self.num_params)
        self.nonfinite_skipped = [0] * num_workers
        self.send_norm = send_norm
        self.cond = threading.Condition()
        self.version = 0
        self.clock = [0] * num_workers
        self.seen = [0] * num_workers
        self.live = [True] * num_workers
        self.stop_flag = False
        self.error: str | None = None
        # sync step in progress
        # worker -> (samples, grads, buffers, hyper, has-gradient mask); grads/buffers None when dropped
        self._sync_pushes: dict[int, _SyncPush] = {}
        self._sync_combined: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, list[bool]] | None = None
        self._norms: dict[int, dict[int, float]] = {}
        # parked replies: (worker, staleness, deliver(snapshot, version, staleness), refuse() or None);
        # refuse answers with an error instead if the shard fails while the reply waits (see fail())
        self._parked: list[tuple[int, int, Callable[[torch.Tensor, int, int], None], Callable[[], None] | None]] = []
        self._snapshot_bufs: dict[int, torch.Tensor] = {}

    # -- update rules (call with self.cond held) -----------------------------------------------
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
        raise PSProtocolError(
            f"shard {self.shard}: push {self.clock[worker] + 1} of worker {worker} holds non-finite values in "
            f"{self.plan.specs[piece.index].name!r} but was not flagged so (a PS client must check its whole push "
            "first); nothing of it was applied"
        )

    def push(self, worker: int, data: torch.Tensor, hyper: torch.Tensor) -> int:
        """Take one push (``data`` = grads then buffers, fp32); returns the staleness assigned to it."""
        if data.numel() != self.n_total:
            raise PSProtocolError(
                f"shard {self.shard}: push from worker {worker} has {data.numel()} values, expected {self.n_total}"
            )
        n_expected = HYPER_PREFIX + self._mask_words + self.spec.num_values
        if hyper.numel() != n_expected:
            raise PSProtocolError(
                f"shard {self.shard}: push has {hyper.numel()} hyperparameters, expected {n_expected}"
            )
        self.live[worker] = True
        skipped = bool(int(hyper[2]) & PushFlag.NONFINITE)
        if skipped:
            self.nonfinite_skipped[worker] += 1
        else:
            self._check_finite(worker, data)
        grads = data[: self.n_param]
        bufs = data[self.n_param :]
        num_samples = 0.0 if skipped else float(hyper[1])
        if self.cfg.mode == "sync":
            if worker in self._sync_pushes:
                raise PSProtocolError(f"shard {self.shard}: worker {worker} pushed twice in step {self.version}")
            kept = (None, None) if skipped else (grads.clone(), bufs.clone())
            self._sync_pushes[worker] = (num_samples, *kept, hyper.clone(), self._has_grad(hyper))
            self.clock[worker] += 1
            if len(self._sync_pushes) == self.num_workers:
                self._combine_sync()
            return 0
        tau = self.version - self.seen[worker]
        if not skipped:
            self._apply_hyper(hyper)
            scale = 1.0 / (tau + 1) if self.cfg.staleness_scaling == "inverse" else 1.0
            self._step(grads, self._has_grad(hyper), lr_scale=scale)
            self._merge_buffers_async(bufs)
        self.clock[worker] += 1
        self._release()
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
            self.version += 1
            self._release()
            return
        has_grad = [any(self._sync_pushes[w][4][i] for w in counted) for i in range(self.num_params)]
        if len(counted) == 1:
            grads, bufs = self._sync_pushes[counted[0]][1], self._sync_pushes[counted[0]][2]
            assert grads is not None and bufs is not None
        else:
            grads = torch.zeros(self.n_param, dtype=torch.float32)
            acc = torch.zeros(self.n_total - self.n_param, dtype=torch.float64)
            pushed = []
            for w in counted:
                n, g, b, _, _ = self._sync_pushes[w]
                assert g is not None and b is not None
                grads.add_(g, alpha=n)  # a worker without a gradient for a param pushed zeros there
                acc.add_(b.double(), alpha=n)
                pushed.append(b)
            grads.div_(total)
            bufs = (acc / total).to(torch.float32)
            self._merge_ints(bufs, pushed)
        max_norm = float(hyper[0])
        self._sync_pushes = {}
        self._sync_combined = (grads, bufs, hyper, max_norm, has_grad)
        if max_norm >= 0:
            sq = float(grads.double().pow(2).sum()) if grads.numel() else 0.0
            self.note_norm(self.version, self.shard, sq)
            if self.send_norm is not None:
                self.send_norm(self.version, sq)
        self._try_apply_sync()

    def note_norm(self, step: int, shard: int, sq: float) -> None:
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
        self._sync_combined = None
        self._apply_hyper(hyper)
        self._step(grads, has_grad)
        if bufs.numel():
            self.buffers.copy_(bufs)
        self._release()

    # -- readiness, snapshots, parked replies ---------------------------------------------------
    def min_live_clock(self) -> int:
        live = [c for c, ok in zip(self.clock, self.live, strict=True) if ok]
        return min(live) if live else max(self.clock)

    def ready(self, worker: int, after_push: bool) -> bool:
        if not after_push:
            return True
        if self.cfg.mode == "sync":
            return self.version >= self.clock[worker]
        if self.cfg.mode == "ssp":
            assert self.cfg.staleness is not None
            return self.clock[worker] - self.min_live_clock() <= self.cfg.staleness
        return True

    def snapshot(self, worker: int) -> tuple[torch.Tensor, int]:
        """Flat fp32 copy of params then buffers; marks what ``worker`` has seen (for staleness).

        The copy goes into a buffer kept per worker (no page faults from a fresh multi-MB tensor per reply).
        Reuse is safe: a worker has at most one request open per shard and reads the whole reply before
        it sends the next, so the previous reply to it has left this buffer.
        """
        out = self._snapshot_bufs.get(worker)
        if out is None:
            out = self._snapshot_bufs[worker] = torch.empty(self.n_total, dtype=torch.float32)
        for m, p in zip(self.masters, self.param_pieces, strict=True):
            out[p.offset : p.offset + p.numel].copy_(m.detach().reshape(-1))
        out[self.n_param :].copy_(self.buffers)
        self.seen[worker] = self.version
        return out, self.version

    def park(
        self,
        worker: int,
        staleness: int,
        deliver: Callable[[torch.Tensor, int, int], None],
        refuse: Callable[[], None] | None = None,
    ) -> None:
        """Send ``worker`` a snapshot through ``deliver`` once it is ready (now, if it already is).

        ``refuse`` answers the worker with an error instead if this shard fails first, so it does not
        wait out its ``timeout`` for a reply that cannot come.
        """
        self._parked.append((worker, staleness, deliver, refuse))
        self._release()

    def _release(self) -> None:
        keep = []
        for worker, staleness, deliver, refuse in self._parked:
            if self.ready(worker, after_push=True):
                snap, version = self.snapshot(worker)
                deliver(snap, version, staleness)
            else:
                keep.append((worker, staleness, deliver, refuse))
        self._parked = keep
        self.cond.notify_all()

    def set_idle(self, worker: int) -> None:
        self.live[worker] = False
        self._release()

    # -- local (in-process) entry points --------------------------------------------------------
    def local_push_pull(
        self, worker: int, data: torch.Tensor, hyper: torch.Tensor, timeout: float
    ) -> tuple[torch.Tensor, int, int]:
        """The co-located worker's push + pull; blocks as the mode requires, at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self._check_error()
            tau = self.push(worker, data, hyper)
            while not self.ready(worker, after_push=True):
                self._check_error()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PSTimeoutError(self._waiting_for(worker, timeout))
                self.cond.wait(min(left, 1.0))
            snap, version = self.snapshot(worker)
            return snap, version, tau

    def local_pull(self, worker: int) -> tuple[torch.Tensor, int]:
        with self.cond:
            self._check_error()
            return self.snapshot(worker)

    def _waiting_for(self, worker: int, timeout: float) -> str:
        if self.cfg.mode == "sync":
            missing = sorted(set(range(self.num_workers)) - set(self._sync_pushes))
            what = f"the pushes of step {self.version} from worker(s) {missing}"
            if self._sync_combined is not None:
                got = self._norms.get(self.version, {})
                what = f"gradient norms of step {self.version} from shard(s) " + str(
                    sorted(set(self.plan.nonempty_shards()) - set(got))
                )
        else:
            slow = [w for w in range(self.num_workers) if self.live[w] and self.clock[w] == self.min_live_clock()]
            what = f"worker(s) {slow} to come within staleness {self.cfg.staleness} (ssp)"
        return f"timed out after {timeout:g} s on shard {self.shard} (worker {worker}) waiting for {what}"

    def _check_error(self) -> None:
        if self.error is not None:
            raise PSProtocolError(f"PS shard {self.shard} failed earlier: {self.error}")

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = f"{type(exc).__name__}: {exc}"
            print(f"[ivyplug.ps] shard {self.shard} error:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            parked, self._parked = self._parked, []
            for _, _, _, refuse in parked:  # waiting remote workers get an error reply now, not a timeout
                if refuse is not None:
                    with contextlib.suppress(Exception):
                        refuse()
            self.cond.notify_all()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_bytes(self) -> bytes:
        """This shard's full state, serialised with torch.save (loaded back with weights_only=True)."""
        with self.cond:
            state = {
                "shard": self.shard,
                "version": self.version,
                "clock": list(self.clock),
                "seen": list(self.seen),
                "params": [m.detach().clone() for m in self.masters],
                "buffers": self.buffers.clone(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            }
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_bytes` output. ``state["reset_clocks"]``: the state was written in another
        mode, whose clocks mean something else (async clocks count each worker's pushes, sync clocks equal
        the version): every worker restarts at the saved version, as after a sync step."""
        with self.cond:
            if state["shard"] != self.shard or len(state["params"]) != len(self.masters):
                raise ValueError(f"state of shard {state['shard']} does not fit shard {self.shard} of this plan")
            if len(state["clock"]) != self.num_workers:
                raise ValueError(
                    f"checkpoint was written by {len(state['clock'])} workers, this job has {self.num_workers}"
                )
            for m, t in zip(self.masters, state["params"], strict=True):
                if tuple(m.shape) != tuple(t.shape):
                    raise ValueError(
                        f"shard {self.shard}: checkpoint tensor shape {tuple(t.shape)} != {tuple(m.shape)}"
                    )
                with torch.no_grad():
                    m.copy_(t)
            self.buffers.copy_(state["buffers"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
                # torch's load_state_dict builds new param-group dicts: re-point the user-group map at them,
                # or the hyperparameters carried by later pushes (LR schedulers) would update stale dicts.
                self.groups = {g: self.optimizer.param_groups[i] for i, g in enumerate(sorted(self.groups))}
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
    """Inverse of :meth:`ShardServer.state_bytes` (tensors and plain containers only: no code runs)."""
    return torch.load(io.BytesIO(blob), weights_only=True)
