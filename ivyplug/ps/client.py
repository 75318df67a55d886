"""The worker-side facade: ``PSClient.start(...)``, ``step``, ``sync``, checkpoints, dispatch, metrics.

Topology (co-located, ``num_servers=0``): every worker rank serves shard ``rank`` of the plan in a
background thread and talks to the other shards over a gloo group of its own; its own shard is called
in-process (gloo cannot send to itself). With ``num_servers=k`` rank 0 starts k dedicated server
processes instead (dedicated.py). A second gloo group among the workers carries the few collectives
(start, sync, epoch start, checkpoints, close), so they never interleave with point-to-point traffic.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import PSConfig
from ivyplug.ps.dedicated import connect, launch, ps_host
from ivyplug.ps.dispatch import BatchQueue
from ivyplug.ps.loop import ServerLoop
from ivyplug.ps.messages import Flag, Header, Kind, Status, bytes_to_words, words_to_bytes
from ivyplug.ps.mirror import OptimizerSpec, is_elementwise
from ivyplug.ps.server import PushFlag, ShardServer, encode_mask, load_state_bytes, nonfinite_in, piece_shape
from ivyplug.ps.sharding import ShardPlan, TensorSpec, auto_max_shard_bytes, build_plan
from ivyplug.ps.transport import Channel, PSProtocolError, PSTimeoutError, wait_work

STATE_FORMAT = "ivyplug.ps/2"  # 2: integer buffers held as int64 bits (format 1 held them as fp32 values)

log = logging.getLogger(__name__)


class PSNonFiniteError(FloatingPointError):
    """A worker's push holds a NaN or Inf and ``PSConfig.nonfinite="raise"``."""


@dataclass
class _Metrics:
    pushes: int = 0
    pulls: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    batches: int = 0
    nonfinite_skipped: int = 0
    per_shard_staleness: list[int] = field(default_factory=list)


def _named(items: Sequence[Any], what: str) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            out.append((f"{what}{i}", item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append((str(item[0]), item[1]))
        else:
            raise ValueError(f"{what}s must be tensors or (name, tensor) pairs, got {type(item).__name__} at {i}")
    return out


class PSClient:
    """One worker's handle on the parameter server (see /work/notes/PS_CONTRACT.md and docs/design.md)."""

    def __init__(self) -> None:  # use PSClient.start
        self.cfg: PSConfig
        self.rank = 0
        self.world_size = 1
        self.plan: ShardPlan
        self.spec: OptimizerSpec
        self.optimizer: Any = None
        self.params: list[tuple[str, torch.Tensor]] = []
        self.buffers: list[tuple[str, torch.Tensor]] = []
        self.server: ShardServer | None = None
        self.queue: BatchQueue | None = None
        self.loop: ServerLoop | None = None
        self.channel: Channel | None = None
        self.p2p_group: Any = None
        self.coll_group: Any = None
        self.stop = threading.Event()
        self._remote_stop = False
        self.epoch: int | None = None
        self.closed = False
        self.m = _Metrics()
        self._push_bufs: dict[int, torch.Tensor] = {}
        self._reply_bufs: dict[int, torch.Tensor] = {}
        self._seq = 0
        self.dedicated = False
        self.server_procs: list[Any] = []
        self._store: Any = None

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        cfg: PSConfig,
        params: Sequence[Any],
        buffers: Sequence[Any] = (),
        optimizer: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> PSClient:
        """Create the PS groups, the plan, this rank's shard server and its thread (collective).

        ``params``/``buffers``: tensors or (name, tensor) pairs in the same order and shapes on every
        rank. ``optimizer``: the worker's torch optimizer over ``params``; its class and per-group
        hyperparameters are mirrored on the servers. Without an initialised default process group only
        ``world_size=1`` is possible (everything in-process).
        """
        if not isinstance(cfg, PSConfig):
            raise ValueError(f"cfg must be a PSConfig, got {type(cfg).__name__}")
        self = cls()
        self.cfg = cfg
        initialised = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
        if world_size > 1 and not initialised:
            raise ValueError("world_size > 1 needs an initialised default process group (torch.distributed)")
        if initialised and (world_size != dist.get_world_size() or rank != dist.get_rank()):
            raise ValueError(
                f"rank/world_size ({rank}/{world_size}) must be this process's default-group rank/world size "
                f"({dist.get_rank()}/{dist.get_world_size()})"
            )
        self.rank, self.world_size = rank, world_size
        self.dedicated = cfg.num_servers > 0
        self.params = _named(params, "param")
        self.buffers = _named(buffers, "buffer")
        if optimizer is None:
            raise ValueError("optimizer is required: its class and hyperparameters are mirrored on the servers")
        self.optimizer = optimizer
        self.spec = OptimizerSpec.from_optimizer(optimizer, [p for _, p in self.params])
        if cfg.mode != "sync" and cfg.staleness_scaling == "inverse":
            missing = [i for i, g in enumerate(optimizer.param_groups) if "lr" not in g]
            if missing:
                raise ValueError(
                    f"staleness_scaling='inverse' scales the servers' learning rate per push, but param group(s) "
                    f"{missing} of {type(optimizer).__name__} have no 'lr'; use staleness_scaling='none'"
                )
        specs = [TensorSpec(n, tuple(p.shape), "param", True) for n, p in self.params]
        specs += [TensorSpec(n, tuple(b.shape), "buffer", b.is_floating_point()) for n, b in self.buffers]
        num_shards = cfg.num_servers if self.dedicated else world_size
        if cfg.max_shard_bytes == "auto":  # resolved here, so dedicated servers receive a plain number
            cfg = replace(cfg, max_shard_bytes=auto_max_shard_bytes(specs, num_shards, is_elementwise(self.spec.cls)))
            self.cfg = cfg
        self.plan = build_plan(specs, num_shards, cfg.max_shard_bytes)
        if world_size > 1:
            self.coll_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout))
            self._check_same_model()
        if self.dedicated:
            self._start_dedicated()
        else:
            self._start_colocated()
        return self

    def _start_colocated(self) -> None:
        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        if world_size > 1:
            self.p2p_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout))
            self.channel = Channel(self.p2p_group, rank, cfg.timeout)
        full = self._flat_local()
        if world_size > 1:
            self._coll_wait(dist.broadcast(full, src=0, group=self.coll_group, async_op=True), "rank 0's parameters")
        shard = rank
        init = torch.empty(self.plan.shard_numel(shard), dtype=torch.float32)
        self._gather_shard(full, shard, init)
        self.server = ShardServer(shard, self.plan, cfg, world_size, self.spec, init, send_norm=self._send_norm)
        if rank == 0:
            self.queue = BatchQueue(world_size)
        if world_size > 1:
            assert self.channel is not None
            others = set(range(world_size)) - {rank}
            self.loop = ServerLoop(self.channel, self.server, self.queue, others, self.stop, workers=others)
            self.loop.start()
            self._barrier("every rank's PS server to start")

    def _start_dedicated(self) -> None:
        """Rank 0 starts the server processes; every worker joins the PS group (see dedicated.py)."""
        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        host = ps_host()
        port = torch.zeros(1, dtype=torch.int64)
        store = None
        if rank == 0:
            store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout)
            )
            port[0] = store.port
            full = self._flat_local()
            values = []
            for s in range(self.plan.num_shards):
                v = torch.empty(self.plan.shard_numel(s), dtype=torch.float32)
                self._gather_shard(full, s, v)
                values.append(v)
            self.server_procs = launch(host, int(port), world_size, cfg, list(self.plan.specs), self.spec, values)
        if world_size > 1:
            self._coll_wait(dist.broadcast(port, src=0, group=self.coll_group, async_op=True), "the PS store port")
        try:
            self.p2p_group, self._store = connect(
                host, int(port), rank, world_size + cfg.num_servers, cfg.timeout, store=store
            )
        except RuntimeError as exc:
            for proc in self.server_procs:  # do not leave half-started servers behind
                proc.kill()
                proc.join(5)
            raise PSTimeoutError(
                f"rank {rank} could not join the PS group of {world_size} workers and {cfg.num_servers} dedicated "
                f"servers at {host}:{int(port)} within {cfg.timeout:g} s: {exc}"
            ) from exc
        self.channel = Channel(self.p2p_group, rank, cfg.timeout)
        if rank == 0:
            self.queue = BatchQueue(world_size)
            if world_size > 1:
                others = set(range(1, world_size))
                self.loop = ServerLoop(self.channel, None, self.queue, others, self.stop)
                self.loop.start()
        self._barrier("every worker to join the PS group")

    # -- flat layouts ---------------------------------------------------------------------------
    def _tensor(self, index: int) -> torch.Tensor:
        n = len(self.params)
        return self.params[index][1] if index < n else self.buffers[index - n][1]

    def _flat_local(self) -> torch.Tensor:
        """All params then buffers of this process, flat fp32 words (used for the initial broadcast)."""
        ts = [p.detach().reshape(-1).float().cpu() for _, p in self.params]
        ts += [_buffer_words(b) for _, b in self.buffers]
        return torch.cat(ts) if ts else torch.zeros(0)

    def _gather_shard(self, full: torch.Tensor, shard: int, out: torch.Tensor) -> None:
        starts = [0]
        for s in self.plan.specs:
            starts.append(starts[-1] + s.words)
        for p in self.plan.pieces[shard]:
            spec = self.plan.specs[p.index]
            row = spec.numel // (spec.shape[0] if spec.shape else 1) if spec.shape else 1
            a = starts[p.index] + p.row_start * row
            out[p.offset : p.offset + p.numel].copy_(full[a : a + p.numel])

    def _shard_buffer(self, pool: dict[int, torch.Tensor], shard: int) -> torch.Tensor:
        """A flat fp32 buffer of ``shard``'s size, allocated once and reused every step.

        A fresh multi-MB tensor per step costs page faults on first touch (glibc serves large blocks with
        mmap), about as much as the copy itself. Reuse is safe: a step waits for its sends (``flush``) and
        unpacks every reply before the next step packs or receives into the same buffer.
        """
        buf = pool.get(shard)
        if buf is None:
            buf = pool[shard] = torch.empty(self.plan.shard_numel(shard), dtype=torch.float32)
        return buf

    def _pack(self, shard: int, clip: float) -> torch.Tensor:
        """This worker's gradients (zeros where None) then buffers of ``shard``, flat fp32 (a reused buffer)."""
        out = self._shard_buffer(self._push_bufs, shard)
        for p in self.plan.pieces[shard]:
            dst = out[p.offset : p.offset + p.numel]
            t = self._tensor(p.index)
            if not p.is_float:
                dst.copy_(_buffer_words(t))
                continue
            if p.kind == "param":
                g = t.grad
                if g is None:
                    dst.zero_()
                    continue
                src = g.detach()
            else:
                src = t.detach()
            if src.dim() > 0 and (p.row_start, p.row_end) != (0, src.shape[0]):
                src = src[p.row_start : p.row_end]
            dst.copy_(src.reshape(-1))
            if p.kind == "param" and clip != 1.0:
                dst.mul_(clip)
        return out

    def _unpack(self, shard: int, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p in self.plan.pieces[shard]:
                t = self._tensor(p.index)
                spec = self.plan.specs[p.index]
                if not p.is_float:  # int64 bits, exact (cloned: a view needs 8-byte alignment)
                    t.copy_(flat[p.offset : p.offset + p.numel].clone().view(torch.int64).view(t.shape))
                    continue
                src = flat[p.offset : p.offset + p.numel].view(piece_shape(spec.shape, p))
                if t.dim() > 0 and (p.row_start, p.row_end) != (0, t.shape[0]):
                    t[p.row_start : p.row_end].copy_(src)
                else:
                    t.copy_(src.view(t.shape) if t.dim() == 0 else src)

    # -- collectives on the PS collective group -------------------------------------------------
    def _coll_wait(self, work: Any, what: str) -> None:
        wait_work(work, self.cfg.timeout, f"{what} (collective on the PS group, rank {self.rank})")

    def _barrier(self, what: str) -> None:
        if self.world_size > 1:
            self._coll_wait(dist.barrier(group=self.coll_group, async_op=True), what)

    def _check_same_model(self) -> None:
        sig = torch.tensor([self.plan.signature()], dtype=torch.int64)
        sigs = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._coll_wait(dist.all_gather(sigs, sig, group=self.coll_group, async_op=True), "model signatures")
        bad = [r for r, s in enumerate(sigs) if int(s) != int(sig)]
        if bad:
            raise ValueError(
                f"params/buffers differ between ranks (names, shapes or order): rank {self.rank} disagrees with "
                f"rank(s) {bad}; pass the same model on every rank"
            )

    # -- messaging ------------------------------------------------------------------------------
    def _server_rank(self, shard: int) -> int:
        return self.world_size + shard if self.dedicated else shard

    def _send_norm(self, step: int, sq: float) -> None:
        """Called by this rank's shard (lock held) to share a sync step's squared norm with the others."""
        assert self.channel is not None or self.world_size == 1
        for s in self.plan.nonempty_shards():
            if s == self.rank or self.channel is None:
                continue
            h = Header(kind=Kind.NORM, sender=self.rank, shard=s, arg0=step, arg1=self.rank)
            self.channel.send(self._server_rank(s), h, None, torch.tensor([sq], dtype=torch.float64), wait=False)

    def _request(
        self,
        kind: int,
        shard: int,
        dst: int,
        data: torch.Tensor | None,
        hyper: torch.Tensor | None,
        reply_numel: int | None,
        **args: int,
    ) -> tuple[torch.Tensor, list[Any], torch.Tensor | None, int]:
        assert self.channel is not None
        self._seq += 1
        if kind in (Kind.PUSH_PULL, Kind.PULL) and reply_numel == self.plan.shard_numel(shard):
            out: torch.Tensor | None = self._shard_buffer(self._reply_bufs, shard)  # unpacked before reuse
        else:
            out = torch.empty(reply_numel, dtype=torch.float32) if reply_numel else None
        hbuf, works = self.channel.post_reply(dst, out)
        h = Header(kind=kind, sender=self.rank, shard=shard, seq=self._seq, **args)
        self.m.bytes_sent += self.channel.send(dst, h, data, hyper, wait=False)
        return hbuf, works, out, self._seq

    def _finish(self, hbuf: torch.Tensor, works: list[Any], dst: int, what: str) -> Header:
        assert self.channel is not None
        t0 = time.monotonic()
        h = self.channel.wait_reply(hbuf, works, f"rank {dst}'s reply to {what}")
        self.m.wait_seconds += time.monotonic() - t0
        if h.status != Status.OK:
            try:
                text = self.channel.recv_error_text(dst, h.arg3)
            except (PSProtocolError, PSTimeoutError) as exc:
                text = f"(its error text could not be received: {exc})"
            raise PSProtocolError(f"PS server on rank {dst} failed while answering {what}: {text or 'no details'}")
        if h.flags & Flag.STOP:
            self._remote_stop = True
        self.m.bytes_received += 128 + 4 * h.numel
        return h

    def _send_simple(self, kind: int, dst: int, **args: int) -> None:
        assert self.channel is not None
        self.m.bytes_sent += self.channel.send(dst, Header(kind=kind, sender=self.rank, **args), wait=True)

    # -- the training-step API ------------------------------------------------------------------
    def pull_initial(self) -> None:
        """Replace this rank's params and buffers with the servers' copy (initialised from rank 0)."""
        self._pull_all("the initial pull")

    def _pull_all(self, what: str) -> None:
        self._check_open()
        pending = []
        for s in self.plan.nonempty_shards():
            dst = self._server_rank(s)
            if dst != self.rank:
                pending.append((s, dst, *self._request(Kind.PULL, s, dst, None, None, self.plan.shard_numel(s))))
        for s in self.plan.nonempty_shards():
            if self._server_rank(s) == self.rank:
                assert self.server is not None
                snap, _ = self.server.local_pull(self.rank)
                self._unpack(s, snap)
        for s, dst, hbuf, works, out, _ in pending:
            self._finish(hbuf, works, dst, f"{what} of shard {s}")
            assert out is not None
            self._unpack(s, out)
        self.m.pulls += 1
        if self.channel is not None:
            self.channel.flush()

    def step(self, num_samples: int, max_grad_norm: float | None = None) -> None:
        """Push this worker's gradients (+ buffers, hyperparameters), wait as the mode says, pull.

        ``num_samples`` weights this worker's gradient in sync mode (uneven batches stay unbiased).
        ``max_grad_norm``: sync clips by the global norm of the combined gradient (computed by the servers);
        async/ssp clip each push by its own global norm here, before pushing.
        """
        self._check_open()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"num_samples must be an int > 0, got {num_samples!r}")
        if max_grad_norm is not None and (not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
        clip = 1.0
        if max_grad_norm is not None and self.cfg.mode != "sync":
            grads = [p.grad for _, p in self.params if p.grad is not None]
            if grads:
                total = torch.nn.utils.get_total_norm(grads)
                clip = float(torch.clamp(max_grad_norm / (total + 1e-6), max=1.0))
        prefix = torch.tensor(
            [
                float(max_grad_norm) if (max_grad_norm is not None and self.cfg.mode == "sync") else -1.0,
                float(num_samples),
            ],
            dtype=torch.float64,
        )
        shards = self.plan.nonempty_shards()
        packed = {s: self._pack(s, clip) for s in shards}
        flags = self._check_push(packed)
        has_grad = encode_mask([p.grad is not None for _, p in self.params])
        extra = torch.tensor([float(flags), *has_grad], dtype=torch.float64)
        hyper = torch.cat([prefix, extra, self.spec.encode(self.optimizer)])
        pending = []
        for s in shards:
            dst = self._server_rank(s)
            if dst != self.rank:
                data = packed[s]
                pending.append((s, dst, *self._request(Kind.PUSH_PULL, s, dst, data, hyper, data.numel())))
        staleness: list[int] = []
        for s in shards:
            if self._server_rank(s) == self.rank:
                assert self.server is not None
                data = packed[s]
                t0 = time.monotonic()
                snap, _, tau = self.server.local_push_pull(self.rank, data, hyper, self.cfg.timeout)
                self.m.wait_seconds += time.monotonic() - t0
                staleness.append(tau)
                self._unpack(s, snap)
        for s, dst, hbuf, works, out, _ in pending:
            h = self._finish(hbuf, works, dst, f"the push/pull of shard {s}")
            assert out is not None
            staleness.append(h.arg0)
            self._unpack(s, out)
        if self.channel is not None:
            self.channel.flush()
        self.m.pushes += 1
        self.m.pulls += 1
        # the servers stepped this optimizer's mirror: tell LR schedulers so (they warn otherwise)
        if hasattr(self.optimizer.step, "_wrapped_by_lr_sched"):
            self.optimizer._opt_called = True
        if staleness:
            tau_max = max(staleness)
            self.m.staleness_sum += tau_max
            self.m.staleness_max = max(self.m.staleness_max, tau_max)

    def _check_push(self, packed: dict[int, torch.Tensor]) -> int:
        """Push flags after checking the whole push (every shard's part) for NaN/Inf, before any is sent.

        Checking here, where the whole push is at hand, makes the policy atomic: every shard gets the same
        flag, so no shard applies part of a push that another drops.
        """
        bad = [s for s, data in packed.items() if nonfinite_in(data, self.plan.float_ranges(s)) is not None]
        if not bad:
            return 0
        step = self.m.pushes + 1
        name = self._first_nonfinite()
        if self.cfg.nonfinite == "raise":
            raise PSNonFiniteError(
                f"rank {self.rank}, step {step}: non-finite values in {name} (the first non-finite tensor of its "
                "push); nonfinite='raise' stops training (nonfinite='skip' drops such a push and goes on)"
            )
        self.m.nonfinite_skipped += 1
        log.warning(
            "ivyplug PS: rank %d, step %d: non-finite values in %s; its whole push was dropped on every shard "
            "(nonfinite='skip', %d so far)",
            self.rank,
            step,
            name,
            self.m.nonfinite_skipped,
        )
        return PushFlag.NONFINITE

    def _first_nonfinite(self) -> str:
        for n, p in self.params:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"the gradient of {n!r}"
        for n, b in self.buffers:
            if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                return f"buffer {n!r}"
        return "a pushed tensor"

    def sync(self) -> None:
        """Collective: let every in-flight push land, then pull the global params and buffers."""
        self._check_open()
        if self.channel is not None:
            for s in self.plan.nonempty_shards():
                dst = self._server_rank(s)
                if dst != self.rank:
                    self._send_simple(Kind.IDLE, dst, shard=s)
        if self.server is not None:
            with self.server.cond:
                self.server.set_idle(self.rank)
        self._barrier("every worker to reach sync()")
        self._pull_all("sync()")

    # -- data dispatch and stop signal ----------------------------------------------------------
    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        """Collective at the start of an epoch: rank 0 refills the batch queue with 0..num_batches-1.

        ``reserved``: batches this worker trains on without asking the queue (the dispatch loader gives
        every worker one, so none ends an epoch empty-handed); counted in ``metrics()["batches"]``.
        """
        self._check_open()
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches must be an int >= 0, got {num_batches!r}")
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            raise ValueError(f"reserved must be an int >= 0, got {reserved!r}")
        self.m.batches += reserved
        if self.rank == 0:
            assert self.queue is not None
            self.queue.reset(epoch, num_batches)
        self.epoch = epoch
        self._barrier(f"every worker to start epoch {epoch}")

    def next_batch(self) -> int | None:
        """The next global batch index of the current epoch, or None when the epoch is exhausted."""
        self._check_open()
        if self.epoch is None:
            raise RuntimeError("next_batch() before start_epoch(): call start_epoch(epoch, num_batches) first")
        if self.rank == 0:
            assert self.queue is not None
            index = self.queue.take(0, self.epoch)
        else:
            hbuf, works, _, _ = self._request(Kind.NEXT_BATCH, -1, 0, None, None, None, arg0=self.epoch)
            index = self._finish(hbuf, works, 0, "next_batch()").arg0
        if index < 0:
            return None
        self.m.batches += 1
        return index

    def request_stop(self) -> None:
        """Raise the stop flag on every PS rank (seen by the others at their next reply or query)."""
        self._check_open()
        self.stop.set()
        for r in self._loop_ranks():
            self._send_simple(Kind.STOP, r)

    def _loop_ranks(self) -> list[int]:
        """Other PS-group ranks that run a server loop (they take STOP and BYE)."""
        if self.channel is None:
            return []
        if not self.dedicated:
            return [r for r in range(self.world_size) if r != self.rank]
        ranks = [self.world_size + s for s in range(self.cfg.num_servers)]
        return ([0] if self.rank != 0 and self.world_size > 1 else []) + ranks

    def stop_requested(self) -> bool:
        return self.stop.is_set() or self._remote_stop

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Collective: every shard's params, buffers, optimizer state, version and clocks (on every rank)."""
        self._check_open()
        self._barrier("every worker to reach state_dict()")
        if self.dedicated:
            blobs = self._fetch_dedicated_states() if self.rank == 0 else []
            blobs = self._share_from_rank0(blobs, self.plan.num_shards)
        else:
            assert self.server is not None
            blobs = self._share_all(self.server.state_bytes())
        shards = [load_state_bytes(b) for b in blobs]
        return {
            "format": STATE_FORMAT,
            "mode": self.cfg.mode,
            "num_servers": self.cfg.num_servers,
            "num_workers": self.world_size,
            "num_shards": self.plan.num_shards,
            "plan_signature": self.plan.signature(),
            "shards": shards,
        }

    def _fetch_dedicated_states(self) -> list[bytes]:
        blobs = []
        for s in range(self.plan.num_shards):
            dst = self._server_rank(s)
            hbuf, works, _, _ = self._request(Kind.STATE_SIZE, s, dst, None, None, None)
            nbytes = self._finish(hbuf, works, dst, f"the state size of shard {s}").arg0
            hbuf, works, out, _ = self._request(Kind.STATE_FETCH, s, dst, None, None, (nbytes + 3) // 4)
            self._finish(hbuf, works, dst, f"the state of shard {s}")
            blobs.append(words_to_bytes(out, nbytes) if out is not None else b"")
        return blobs

    def _share_all(self, blob: bytes) -> list[bytes]:
        """All-gather one byte string per rank over the PS collective group."""
        if self.world_size == 1:
            return [blob]
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._coll_wait(dist.all_gather(sizes, size, group=self.coll_group, async_op=True), "checkpoint sizes")
        longest = max(1, max(int(x) for x in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._coll_wait(dist.all_gather(parts, padded, group=self.coll_group, async_op=True), "checkpoint shards")
        return [parts[r][: int(sizes[r])].numpy().tobytes() for r in range(self.world_size)]

    def _share_from_rank0(self, blobs: list[bytes], count: int) -> list[bytes]:
        """Broadcast rank 0's ``count`` byte strings to every worker."""
        if self.world_size == 1:
            return blobs
        sizes = torch.tensor([len(b) for b in blobs] if self.rank == 0 else [0] * count, dtype=torch.int64)
        self._coll_wait(dist.broadcast(sizes, src=0, group=self.coll_group, async_op=True), "checkpoint sizes")
        data = torch.zeros(max(1, int(sizes.sum())), dtype=torch.uint8)
        if self.rank == 0 and int(sizes.sum()):
            data[: int(sizes.sum())] = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        self._coll_wait(dist.broadcast(data, src=0, group=self.coll_group, async_op=True), "checkpoint shards")
        raw = data.numpy().tobytes()
        out, start = [], 0
        for n in sizes.tolist():
            out.append(raw[start : start + n])
            start += n
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: restore every shard from :meth:`state_dict` output (given on every rank), then pull."""
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a PS state dict of this ivyplug (format {found!r}, expected {STATE_FORMAT!r})")
        saved, here = _topology(state), _topology(self.state_meta())
        if state["num_shards"] != self.plan.num_shards or state["plan_signature"] != self.plan.signature():
            raise ValueError(
                f"cannot resume: the PS state was saved by a job with {saved}, this job has {here}; the shard plan "
                "differs: another model, number of shards or max_shard_bytes (resume with the same ones)"
            )
        if state.get("num_workers", self.world_size) != self.world_size:
            raise ValueError(f"cannot resume: the PS state was saved by a job with {saved}, this job has {here}")
        # another mode: parameters, buffers and optimizer state carry over; clocks restart at the version
        convert = state["mode"] != self.cfg.mode
        shards = [dict(sh, reset_clocks=True) if convert else sh for sh in state["shards"]]
        if convert:
            log.info("ivyplug PS: resuming a %s-mode state in %s mode (clocks restart)", state["mode"], self.cfg.mode)
        self._barrier("every worker to reach load_state_dict()")
        if self.dedicated:
            if self.rank == 0:
                for s in range(self.plan.num_shards):
                    buf = io.BytesIO()
                    torch.save(shards[s], buf)
                    blob = buf.getvalue()
                    dst = self._server_rank(s)
                    hbuf, works, _, _ = self._request(
                        Kind.LOAD, s, dst, bytes_to_words(blob), None, None, arg0=len(blob)
                    )
                    self._finish(hbuf, works, dst, f"loading the state of shard {s}")
        else:
            assert self.server is not None
            self.server.load_state(shards[self.server.shard])
        self._barrier("every shard to load its state")
        self._pull_all("the pull after load_state_dict()")

    def state_meta(self) -> dict[str, Any]:
        """What a state dict records about the job that wrote it (mode and topology)."""
        return {
            "mode": self.cfg.mode,
            "num_servers": self.cfg.num_servers,
            "num_workers": self.world_size,
            "num_shards": self.plan.num_shards,
        }

    # -- metrics and teardown ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """This worker's PS counters (names without the ``ivy/`` prefix)."""
        m = self.m
        return {
            "pushes": float(m.pushes),
            "pulls": float(m.pulls),
            "staleness_mean": m.staleness_sum / m.pushes if m.pushes else 0.0,
            "staleness_max": float(m.staleness_max),
            "bytes_sent": float(m.bytes_sent),
            "bytes_received": float(m.bytes_received),
            "wait_seconds": m.wait_seconds,
            "batches": float(m.batches),
            "nonfinite_skipped": float(m.nonfinite_skipped),
        }

    def server_versions(self) -> dict[int, int]:
        """Version of the shard this rank serves (local, no communication)."""
        assert self.server is not None
        with self.server.cond:
            return {self.server.shard: self.server.version}

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("PSClient is closed")
        if self.server is not None and self.server.error is not None:
            raise PSProtocolError(f"the PS shard on rank {self.rank} failed: {self.server.error}")

    def close(self) -> None:
        """Stop the server thread/processes (after every peer said BYE) and drop the PS groups. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.channel is None:
            return
        err: BaseException | None = None
        try:
            for r in self._loop_ranks():
                self.channel.send(r, Header(kind=Kind.BYE, sender=self.rank), wait=True)
            if self.loop is not None:
                self.loop.join(self.cfg.timeout)
                if self.loop.is_alive():
                    raise PSTimeoutError(
                        f"timed out after {self.cfg.timeout:g} s on rank {self.rank} waiting for the other ranks to "
                        f"close the PS ({self.loop.byes} of {len(self.loop.expect_bye)} said goodbye)"
                    )
            self.channel.flush()
            self._barrier("every rank to close the PS")
            deadline = time.monotonic() + self.cfg.timeout
            for p in self.server_procs:
                p.join(max(0.1, deadline - time.monotonic()))
            alive = [p.name for p in self.server_procs if p.is_alive()]
            if alive:
                raise PSTimeoutError(f"timed out after {self.cfg.timeout:g} s waiting for {alive} to exit")
        except BaseException as exc:
            err = exc
        finally:
            for p in self.server_procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if err is None:
            if not self.dedicated:
                dist.destroy_process_group(self.p2p_group)
            if self.coll_group is not None:
                dist.destroy_process_group(self.coll_group)
            self.p2p_group = None
            self.channel = None
            self._store = None
        if err is not None:
            raise err


def _buffer_words(b: torch.Tensor) -> torch.Tensor:
    """A buffer as flat fp32 words: float buffers by value, integer ones as their int64 bits (exact)."""
    flat = b.detach().reshape(-1).cpu()
    if b.is_floating_point():
        return flat.float()
    return flat.to(torch.int64).view(torch.float32)


def _topology(state: dict[str, Any]) -> str:
    """'mode async, 2 workers, 2 shards (one per worker)' for error messages."""
    servers = state.get("num_servers")
    where = "one per worker" if servers == 0 else (f"num_servers={servers}" if servers is not None else "?")
    workers = state.get("num_workers", "?")
    return f"mode {state.get('mode')!r}, {workers} workers, {state.get('num_shards')} shards ({where})"
