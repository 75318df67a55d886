"""One PS shard: fp32 master parameters, the mirrored optimizer, a version counter, worker clocks.

The shard is a state machine guarded by one condition variable. It is driven from two threads: the
co-located worker calls it directly (gloo cannot send to itself) and the server loop thread calls it
for remote requests. Replies that must wait (sync: until every worker's push of the step is applied;
ssp: until the slowest live worker is within ``staleness`` steps) are parked and sent when ready.

Update rules (documented in docs/design.md):
- sync: the step's gradients are combined in worker-rank order as sum(n_w * g_w) / sum(n_w) (so the
  result does not depend on arrival order, and uneven batches are unbiased); with ``max_grad_norm`` the
  servers exchange squared shard norms and every shard scales by the global clip coefficient.
- async/ssp: each push is applied on arrival, scaled by 1/tau when ``staleness_scaling="inverse"`` and
  its staleness tau (shard version now minus the version this worker last pulled) is >= 2.
- buffers: sync: weighted mean of the step's pushed buffers; async/ssp: running mean
  ``b += (pushed - b) / num_workers`` (equal to the pushed value with one worker); integer buffers
  (``num_batches_tracked``) take the max. Workers replace their buffers with the server's on every pull.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import threading
import time
import traceback
from collections import deque
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


#: how many SSP releases a shard remembers
SSP_TRACE_LEN = 10_000

#: hyper vector layout sent with every push: [max_grad_norm or -1, num_samples, *optimizer values]
HYPER_PREFIX = 2


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
        self._buffer_int = torch.zeros(self.buffers.numel(), dtype=torch.bool)
        for p in self.buffer_pieces:
            if not plan.specs[p.index].is_float:
                self._buffer_int[p.offset - self.n_param : p.offset - self.n_param + p.numel] = True
        self.send_norm = send_norm
        self.cond = threading.Condition()
        self.version = 0
        self.clock = [0] * num_workers
        self.seen = [0] * num_workers
        self.live = [True] * num_workers
        self.stop_flag = False
        self.error: str | None = None
        # sync step in progress
        self._sync_pushes: dict[int, tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._sync_combined: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None
        self._norms: dict[int, dict[int, float]] = {}
        # (worker, its clock, min live clock) at each ssp release; the latest ones only (for tests/diagnosis)
        self.ssp_trace: deque[tuple[int, int, int]] = deque(maxlen=SSP_TRACE_LEN)
        # parked replies: (worker, staleness, deliver(snapshot, version, staleness), refuse() or None);
        # refuse answers with an error instead if the shard fails while the reply waits (see fail())
        self._parked: list[tuple[int, int, Callable[[torch.Tensor, int, int], None], Callable[[], None] | None]] = []
        self._snapshot_bufs: dict[int, torch.Tensor] = {}

    # -- update rules (call with self.cond held) -----------------------------------------------
    def _apply_hyper(self, hyper: torch.Tensor) -> None:
        if self.optimizer is not None:
            self.spec.decode_into(hyper[HYPER_PREFIX:], self.groups)

    def _step(self, grads: torch.Tensor) -> None:
        """Apply one optimizer step with ``grads`` (flat fp32 over this shard's params)."""
        if self.optimizer is not None:
            for m, p, g in zip(self.masters, self.param_pieces, self.piece_group, strict=True):
                m.grad = grads[p.offset : p.offset + p.numel].view(m.shape) if g >= 0 else None
            with torch.no_grad():
                self.optimizer.step()
            for m in self.masters:
                m.grad = None
        self.version += 1

    def push(self, worker: int, data: torch.Tensor, hyper: torch.Tensor) -> int:
        """Take one push (``data`` = grads then buffers, fp32); returns the staleness assigned to it."""
        if data.numel() != self.n_total:
            raise PSProtocolError(
                f"shard {self.shard}: push from worker {worker} has {data.numel()} values, expected {self.n_total}"
            )
        n_expected = HYPER_PREFIX + self.spec.num_values
        if hyper.numel() != n_expected:
            raise PSProtocolError(
                f"shard {self.shard}: push has {hyper.numel()} hyperparameters, expected {n_expected}"
            )
        self.live[worker] = True
        grads = data[: self.n_param]
        bufs = data[self.n_param :]
        num_samples = float(hyper[1])
        if self.cfg.mode == "sync":
            if worker in self._sync_pushes:
                raise PSProtocolError(f"shard {self.shard}: worker {worker} pushed twice in step {self.version}")
            self._sync_pushes[worker] = (num_samples, grads.clone(), bufs.clone(), hyper.clone())
            self.clock[worker] += 1
            if len(self._sync_pushes) == self.num_workers:
                self._combine_sync()
            return 0
        tau = self.version - self.seen[worker]
        if self.cfg.staleness_scaling == "inverse" and tau >= 2:
            grads = grads * (1.0 / tau)
        self._apply_hyper(hyper)
        self._step(grads)
        self._merge_buffers_async(bufs)
        self.clock[worker] += 1
        self._release()
        return tau

    def _merge_buffers_async(self, bufs: torch.Tensor) -> None:
        if bufs.numel() == 0:
            return
        if self.num_workers == 1:
            self.buffers.copy_(bufs)
            return
        mean = self.buffers + (bufs - self.buffers) / self.num_workers
        self.buffers = torch.where(self._buffer_int, torch.maximum(self.buffers, bufs), mean)

    def _combine_sync(self) -> None:
        order = sorted(self._sync_pushes)
        total = sum(self._sync_pushes[w][0] for w in order)
        if total <= 0:
            raise PSProtocolError(f"shard {self.shard}: step {self.version} has no samples")
        if len(order) == 1:
            grads, bufs = self._sync_pushes[order[0]][1], self._sync_pushes[order[0]][2]
        else:
            grads = torch.zeros(self.n_param, dtype=torch.float32)
            bufs = torch.zeros(self.n_total - self.n_param, dtype=torch.float64)
            bmax = torch.full_like(bufs, -math.inf)
            for w in order:
                n, g, b, _ = self._sync_pushes[w]
                grads.add_(g, alpha=n)
                bufs.add_(b.double(), alpha=n)
                bmax = torch.maximum(bmax, b.double())
            grads.div_(total)
            bufs = torch.where(self._buffer_int, bmax, bufs / total).to(torch.float32)
        hyper = self._sync_pushes[order[0]][3]  # the lowest rank's hyperparameters: independent of arrival order
        max_norm = float(hyper[0])
        self._sync_pushes = {}
        self._sync_combined = (grads, bufs, hyper, max_norm)
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
        grads, bufs, hyper, max_norm = self._sync_combined
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
        self._step(grads)
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

    def _record_release(self, worker: int) -> None:
        if self.cfg.mode == "ssp":
            self.ssp_trace.append((worker, self.clock[worker], self.min_live_clock()))

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
                self._record_release(worker)
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
            self._record_release(worker)
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
            self.clock = [int(c) for c in state["clock"]]
            self.seen = [int(c) for c in state["seen"]]
            self._sync_pushes = {}
            self._sync_combined = None
            self._norms = {}


def load_state_bytes(blob: bytes) -> dict[str, Any]:
    """Inverse of :meth:`ShardServer.state_bytes` (tensors and plain containers only: no code runs)."""
    return torch.load(io.BytesIO(blob), weights_only=True)
