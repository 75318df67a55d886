"""The worker-side facade: ``PSClient.start(...)``, ``step``, ``sync``, checkpoints, dispatch, metrics.

Where the shards run is topology.py's business (co-located or dedicated servers); here every operation is
one loop over the shard endpoints (server/endpoints.py), whatever they are: post each shard's request, then
collect the replies and unpack them (layout.py). The few collectives among workers (start, sync, epoch
start, checkpoints, close) run on a group of their own (worker_group.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import socket
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps.config import PSConfig
from ivyplug.ps.server.batch_queue import WAIT, check_count, check_epoch
from ivyplug.ps.server.endpoints import PendingReply, PSServerError, WireEndpoint, WireReply, WireStats
from ivyplug.ps.server.mirror import OptimizerSpec, is_elementwise
from ivyplug.ps.server.shard import load_state_bytes
from ivyplug.ps.server.split_trust import combines_trust
from ivyplug.ps.sharding import ShardPlan, auto_max_shard_bytes, build_plan, tensor_specs
from ivyplug.ps.wire import shared_region
from ivyplug.ps.wire.codecs import BF16_OVERFLOW, BLOCK_BITS, PULL_BITS, Bf16Codec, BlockCodec, PulledCopy
from ivyplug.ps.wire.messages import BatchAsk, Header, Kind
from ivyplug.ps.wire.push import PushFlag, hyper_prefix, nonfinite_in, nonfinite_in_parts
from ivyplug.ps.wire.transport import PSProtocolError, PSTimeoutError
from ivyplug.ps.worker import checkpoint, service_link, topology
from ivyplug.ps.worker.ask_ahead import AskAhead
from ivyplug.ps.worker.early_push import WASTED_STEPS, EarlyPush
from ivyplug.ps.worker.layout import FlatLayout
from ivyplug.ps.worker.member_group import MemberGroup
from ivyplug.ps.worker.optimizer import mark_stepped
from ivyplug.ps.worker.worker_group import WorkerGroup

STATE_FORMAT = checkpoint.STATE_FORMAT

#: bytes of the all-reduce that times the link between the workers' hosts (``PSClient._splits_lamb``): large enough
#: that an all-reduce's fixed cost on a busy machine (thread hand-offs, scheduling) does not make a fast link look
#: slow. Between two emulated hosts on a loaded 2-core machine, 1 MB read an unlimited link at 257-709 MB/s (and
#: once below 250 in a CI run) and 1 Gbit/s at 62-83; 4 MB read 480-825 and 55-98
LINK_PROBE_BYTES = 4 << 20
#: below this all-reduce rate (bytes of the tensor per second; 1.6 Gbit/s) "auto" splits LAMB's tensors across hosts
#: in sync mode. Measured on two emulated hosts: splitting took sync from 1.75x to 1.07x DDP's epoch at 100 Mbit/s
#: and from 1.61x to 1.15x at 1 Gbit/s, and from 1.12x to 1.39x on an unlimited link
SPLIT_BELOW_BYTES_PER_S = 200e6
#: seconds :meth:`PSClient.abort` waits for a request in flight on another thread before it leaves without it
ABORT_LOCK_WAIT_S = 5.0

log = logging.getLogger(__name__)


class PSNonFiniteError(FloatingPointError):
    """A worker's push holds a NaN or Inf and ``PSConfig.nonfinite="raise"``."""


@dataclass
class _Metrics:
    pushes: int = 0
    pulls: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    batches: int = 0
    nonfinite_skipped: int = 0
    shards_sent_early: int = 0  # shards whose data a step took from backward's gradient hooks
    shards_sent_again: int = 0  # shards sent early whose data changed before the step
    wire: WireStats = field(default_factory=WireStats)


def _positive_number(x: object) -> bool:
    """An int or float > 0, inf included (clips nothing, as in torch); not NaN, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


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


class _Unreachable(Exception):
    """close() of a client whose servers could not be reached: no goodbye."""


class PSClient:
    """One worker's handle on the parameter server (see docs/design.md)."""

    def __init__(self) -> None:  # use PSClient.start
        self.cfg: PSConfig
        self.rank = 0
        self.world_size = 1
        self.plan: ShardPlan
        self.spec: OptimizerSpec
        self.optimizer: Any = None
        self._unmirrored: set[str] = set()  # changes to the optimizer's groups already warned about
        self.layout: FlatLayout
        self.workers: WorkerGroup | MemberGroup
        self._launch_group: WorkerGroup | None = None  # the group of the start, while a MemberGroup serves
        self.topo: topology.Topology
        self.stop = threading.Event()
        self.epoch: int | None = None
        self._epoch_ended = False
        #: the batch queue's answer to a request sent ahead, while the last batch trained (``_ask_queue``)
        self._asked_ahead: WireReply | None = None
        self._ask_ahead = AskAhead()
        self.closed = False
        #: the error of a request to servers outside the workers (an ivyplug serve, dedicated servers), if one failed
        self.unreachable: BaseException | None = None
        self._failed = False  # abort(): closed after this worker failed
        self.m = _Metrics()
        #: sync mode, after each ``step``: squared L2 norm of the combined gradient the servers applied (the
        #: sample-weighted mean over workers, before clipping), summed over shards; ``None`` in async/ssp,
        #: before the first step, and after a step whose every push was dropped. With this worker's own
        #: gradient norm it gives the gradient noise scale (``ivyplug.load.goodput``) at no extra traffic.
        self.combined_grad_sq_norm: float | None = None
        #: backward's gradient hooks that send each shard's data early (PSConfig.overlap_backward), else None
        self.early: EarlyPush | None = None
        self._scales_pushes = False  # async/ssp clipping rescales every push at the step: nothing to send early
        self._shm_failed = False  # a shared-memory region could not be made: warned once, every shard on gloo
        self._spans: bool | None = None  # whether the job's workers run on several hosts (_spans_hosts), once asked
        # the number of the last push (wire/push.py): from the start time in µs, so that a restarted worker's
        # numbers never meet those of its last life (exact in fp64 for centuries)
        self._push_number = time.time_ns() // 1000
        # held around every use of the shard endpoints (a step, a pull, sync, checkpoints, close): an optimizer
        # with overlapped exchanges steps from a thread of its own while the training thread asks for batches
        self._lock = threading.RLock()

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
        named_params, named_buffers = _named(params, "param"), _named(buffers, "buffer")
        if optimizer is None:
            raise ValueError("optimizer is required: its class and hyperparameters are mirrored on the servers")
        self.optimizer = optimizer
        self.spec = OptimizerSpec.from_optimizer(optimizer, [p for _, p in named_params])
        if cfg.mode != "sync" and cfg.staleness_scaling == "inverse":
            missing = [i for i, g in enumerate(optimizer.param_groups) if "lr" not in g]
            if missing:
                raise ValueError(
                    f"staleness_scaling='inverse' scales the servers' learning rate per push, but param group(s) "
                    f"{missing} of {type(optimizer).__name__} have no 'lr'; use staleness_scaling='none'"
                )
        specs = tensor_specs(named_params, named_buffers)
        link = service_link.connect(cfg) if cfg.servers is not None else None
        num_shards = link.num_shards if link is not None else (cfg.num_servers if cfg.num_servers > 0 else world_size)
        self.workers = WorkerGroup(rank, world_size, cfg.timeout)
        if cfg.max_shard_bytes == "auto":  # resolved here, so dedicated servers receive a plain number
            splits = is_elementwise(self.spec.cls) or self._splits_lamb(colocated=link is None and not cfg.num_servers)
            cfg = replace(cfg, max_shard_bytes=auto_max_shard_bytes(specs, num_shards, splits))
            self.cfg = cfg
        self.plan = build_plan(specs, num_shards, cfg.max_shard_bytes)
        self._check_split_trust(link is None or len(link.services) <= 1)
        self.layout = FlatLayout(self.plan, named_params, named_buffers)
        self._check_same_model()
        job = topology.WorkerJob(
            cfg, self.plan, self.spec, self.layout, rank, world_size, self.workers, self.stop, self.m.wire
        )
        if link is not None:
            try:
                self.topo = topology.external(job, link)
            except BaseException:
                service_link.close(link)
                raise
            if link.heartbeat is not None:
                # a client dropped without close() (lost by a failed caller) stops beating once collected: its
                # thread and store connection would otherwise live as long as the process
                weakref.finalize(self, link.heartbeat.stop)
        elif cfg.num_servers > 0:
            self.topo = topology.dedicated(job)
        else:
            self.topo = topology.colocated(job)
        # a bf16 or quantized wire is for the links between hosts: in a job across hosts a shard whose server shares
        # this host's memory travels in fp32 there; a job on one host keeps the wire it asked for everywhere
        exact_nearby = cfg.wire_dtype == "float32" or self._spans_hosts()
        for s, ep in self.topo.endpoints.items():  # shards across the wire
            if not isinstance(ep, WireEndpoint):
                continue
            ep.host_buffer = functools.partial(self.layout.host_buffer, shard=s)
            if exact_nearby and self._share(s, ep):  # a server on this host: fp32 in memory both map
                continue
            if cfg.wire_dtype != "float32":  # pushes and pulls in bf16, or pushes quantized (wire/codecs.py)
                ep.bf16 = Bf16Codec(self.plan.shard_numel(s), self.plan.float_ranges(s))
                if cfg.wire_dtype in BLOCK_BITS:
                    bits = BLOCK_BITS[cfg.wire_dtype]
                    ep.block = BlockCodec(self.plan.shard_numel(s), self.plan.shard_param_numel(s), bits)
                    pulls = BlockCodec(self.plan.shard_numel(s), self.plan.shard_param_numel(s), PULL_BITS)
                    ep.pulled = PulledCopy(pulls, ep.bf16)
            else:  # fp32: cut so that large tensors travel in place (wire/segments.py)
                ep.segments = self.layout.segments[s]
        if self.topo.link is not None and world_size > 1:
            # from here on the workers meet through the service: a worker that dies leaves, never hangs them
            self._launch_group = self.workers
            self.workers = MemberGroup(self.topo.link, rank, world_size, cfg.timeout, self.m.wire)
        if cfg.overlap_backward:
            self.early = EarlyPush(self.layout, self._send_early)
        return self

    def _share(self, shard: int, ep: WireEndpoint) -> bool:
        """Keep ``shard``'s pushes and pulls in shared memory with its server (wire/shared_region.py) where that
        server is on this host (a co-located rank, dedicated servers, an ``ivyplug serve``) and the shard's
        tensors are packed on the CPU; True if they are. Such a shard travels as exact fp32; with a bf16 or quantized
        ``wire_dtype`` it is tried only in a job across hosts (:meth:`_spans_hosts`), where rounding bytes that cross
        no link would lose precision and save nothing (docs/benchmarks.md, "Async with the servers on one host")."""
        if not self.cfg.shared_memory or self._shm_failed:
            return False
        if self.layout.staging_device(shard) is not None:  # CUDA: the pinned host buffer and one copy
            return False
        numel = self.plan.shard_numel(shard)
        try:
            region = shared_region.create(numel)
        except OSError as exc:
            self._shm_failed = True
            warnings.warn(
                f"ivyplug PS (rank {self.rank}): pushes travel over gloo, not shared memory: a region of "
                f"{4 * numel / 2**20:.1f} MiB for shard {shard} could not be made in {shared_region.SHM_DIR} "
                f"({exc}); PSConfig(shared_memory=False) says so without this warning",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        try:
            shared = ep.share(region)
        finally:
            region.unlink()  # mapped by both now (or by none): nothing is left behind in /dev/shm
        if shared:
            self.layout.use_push_buffer(shard, region.tensor)
        return shared

    def _splits_lamb(self, colocated: bool) -> bool:
        """Whether ``max_shard_bytes="auto"`` splits LAMB's large tensors (collective where it may).

        Its pieces then take the whole tensor's trust ratio, through an exchange among the shards (server/
        split_trust.py) that costs each step a message between them. It pays in sync mode where the shards are
        co-located with workers on more than one host and the link between them is slow: every step waits for
        every shard, and a whole layer on one host's shard crosses that host's link twice per step (push, then
        reply), one direction after the other. On a fast link the exchange costs more than the balance saves, and
        in async a worker next to the whole layer trains at its own speed, so there the tensors stay whole
        (measured: docs/design.md, "Across hosts"). The link is timed here with an all-reduce of
        :data:`LINK_PROBE_BYTES`; below :data:`SPLIT_BELOW_BYTES_PER_S` the tensors are split. An explicit
        ``max_shard_bytes`` splits them in every mode, exactly.
        """
        if not (combines_trust(self.spec.cls) and self.cfg.mode == "sync" and colocated and self.world_size > 1):
            return False
        if not self._spans_hosts():
            return False
        workers = self.workers
        assert isinstance(workers, WorkerGroup)  # co-located: the workers meet in their own group
        rate = workers.link_rate(LINK_PROBE_BYTES)
        split = rate < SPLIT_BELOW_BYTES_PER_S
        log.info(
            "ivyplug PS: an all-reduce of %d MB between the workers' hosts ran at %.0f MB/s: LAMB's large tensors %s",
            LINK_PROBE_BYTES >> 20,
            rate / 1e6,
            f"are split across hosts (below {SPLIT_BELOW_BYTES_PER_S / 1e6:.0f} MB/s)" if split else "stay whole",
        )
        return split

    def _spans_hosts(self) -> bool:
        """Whether this job's workers run on more than one host (by hostname); asked of every worker at once, at
        start, while they meet in the job's own group."""
        if self._spans is None:  # set only once answered: a gather that timed out is not taken for "one host"
            spans = False
            if self.world_size > 1:
                host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
                spans = len({int(h) for h in self.workers.all_gather(host, "the workers' hostnames")}) > 1
            self._spans = spans
        return self._spans

    def _check_split_trust(self, one_house: bool) -> None:
        """A LAMB tensor cut across shards (``max_shard_bytes``) takes its whole tensor's trust ratio, which the
        shards sum among themselves: refused where they cannot reach each other (several ivyplug serve processes)."""
        split = self.plan.split_tensors() if combines_trust(self.spec.cls) else []
        if split and not one_house:
            raise ValueError(
                f"max_shard_bytes={self.cfg.max_shard_bytes} splits LAMB tensor(s) {split} across shards held by "
                "several ivyplug serve processes, which cannot combine their trust ratios; use "
                "max_shard_bytes='auto' or hold every shard in one service"
            )

    @property
    def params(self) -> list[tuple[str, torch.Tensor]]:
        return self.layout.params

    @property
    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.layout.buffers

    @property
    def dedicated(self) -> bool:
        """Whether the shards live outside the workers (``num_servers=k`` or an ``ivyplug serve``)."""
        return self.cfg.num_servers > 0 or self.cfg.servers is not None

    @property
    def worker(self) -> int:
        """This worker's index in its job: its rank, or the slot an ``ivyplug serve`` gave it (the rank a lone
        worker of a serve's job logs its metrics under: each is rank 0 of a job of its own)."""
        link = self.topo.link
        return link.slot if link is not None and link.slot >= 0 else self.rank

    @property
    def num_workers(self) -> int:
        """Worker slots of the servers: the job's size, or an ``ivyplug serve``'s ``--workers``."""
        link = self.topo.link
        return link.num_workers if link is not None else self.world_size

    @property
    def server_procs(self) -> list[Any]:
        return self.topo.server_procs

    def _check_same_model(self) -> None:
        sig = torch.tensor([self.plan.signature()], dtype=torch.int64)
        sigs = self.workers.all_gather(sig, "model signatures")
        bad = [r for r, s in enumerate(sigs) if int(s) != int(sig)]
        if bad:
            raise ValueError(
                f"params/buffers differ between ranks (names, shapes or order): rank {self.rank} disagrees with "
                f"rank(s) {bad}; pass the same model on every rank"
            )

    # -- the training-step API ------------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Hold the client's request lock (``PSConfig.timeout``): one request to the shards at a time."""
        if not self._lock.acquire(timeout=self.cfg.timeout):
            raise PSTimeoutError(
                f"rank {self.rank}: {what} waited more than timeout={self.cfg.timeout:g} s for the request in "
                "progress on another thread (an overlapped exchange) to end"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _collect(
        self, pending: list[tuple[int, PendingReply]], only: set[int] | None = None
    ) -> tuple[list[int], float]:
        """Wait for every shard's reply, unpack it (into the parameters ``only`` indexes, None: all); returns the
        replies' staleness and summed ``grad_sq``."""
        staleness = []
        grad_sq = 0.0
        for s, reply in pending:
            r = reply.result(self.cfg.timeout)
            staleness.append(r.staleness)
            grad_sq += r.grad_sq
            try:
                self.layout.unpack(s, r.snapshot, r.placed, only)
            finally:
                r.release()  # a co-located shard lent its state: it may write it again
        self._flush_sends()
        return staleness, grad_sq

    def _flush_sends(self) -> None:
        """Wait until every message this worker sent without waiting has left (its buffers are free again)."""
        if self.topo.channel is not None:
            self.topo.channel.flush()
        for other in self.topo.others:
            other.channel.flush()

    def _send_early(self, shard: int, data: torch.Tensor) -> None:
        """From a gradient hook (early_push.py): shard ``shard``'s data, ahead of the step's commit."""
        with self._servers_named():
            self.topo.endpoints[shard].push_data(self.rank, data)

    def hold_pushes(self) -> contextlib.AbstractContextManager[None]:
        """Backward inside sends nothing early (gradient accumulation: a micro-batch that does not step)."""
        return self.early.hold() if self.early is not None else contextlib.nullcontext()

    def stop_early_pushes(self) -> None:
        """Remove the gradient hooks: the ``.grad`` fields a step pushes are not set by backward (deltas)."""
        if self.early is not None:
            self.early.close()
            self.early = None

    @contextlib.contextmanager
    def _servers_named(self) -> Iterator[None]:
        """Errors of a request to servers outside the workers name where they are (the rank says nothing)."""
        try:
            yield
        except (PSProtocolError, PSTimeoutError) as exc:
            link = self.topo.link
            if link is None:
                raise
            if not isinstance(exc, PSServerError):  # a server's error reply came over a working link
                self.unreachable = exc
            what = "dedicated servers" if self.cfg.num_servers else "ivyplug serve"
            text = f"the {what} at {link.address}: {exc}"
            raise (PSServerError(text, exc.text) if isinstance(exc, PSServerError) else type(exc)(text)) from exc

    def pull_initial(self) -> None:
        """Replace this rank's params and buffers with the servers' copy (initialised from rank 0), in the wire's
        form: the steps' pulls replace it (with a bf16 or int wire each rank starts from the copy rounded so)."""
        self._pull_all()

    def _pull_all(self, exact: bool = False) -> None:
        """Pull every shard; ``exact``: in fp32 over a bf16 or quantized wire too (a step's pull, replaced by the
        next one, travels in the wire's form; a pull that stays, as at ``sync()``, exact)."""
        self._check_open()
        with self._exclusive("a pull"), self._servers_named():
            pending = [
                (s, ep.pull(self.rank, self._reply_targets(s), exact=exact)) for s, ep in self.topo.endpoints.items()
            ]
            self._collect(pending)
        self.m.pulls += 1
        self._arm_early()

    def step(
        self,
        num_samples: int,
        max_grad_norm: float | None = None,
        *,
        clip_value: float | None = None,
        delta: bool = False,
        params: Collection[torch.Tensor] | None = None,
    ) -> None:
        """Push this worker's gradients (+ buffers, hyperparameters), wait as the mode says, pull.

        ``delta=True``: the ``.grad`` fields hold a local-update pseudo-gradient (localsgd/delta_exchange.py), which
        the servers scale for staleness by their delta rule (``ivyplug.ps.server.shard.staleness_factor``).
        ``num_samples`` weights this worker's gradient in sync mode (uneven batches stay unbiased).
        ``max_grad_norm``: sync clips by the global norm of the combined gradient (computed by the servers);
        async/ssp clip each push by its own global norm here, before pushing.
        ``clip_value``: sync clamps the combined gradient to ``[-clip_value, clip_value]`` on the servers (as DDP
        clamps the averaged one: a clamp of each worker's gradient is not the same); async/ssp clamp each push here.
        ``params``: push only these parameters' gradients (one of several optimizers' steps, ps/worker/optimizer.py);
        the others count as having none, so the servers leave them as they are. Default: every parameter.
        """
        self._check_open()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise ValueError(f"num_samples must be an int > 0, got {num_samples!r}")
        for name, bound in (("max_grad_norm", max_grad_norm), ("clip_value", clip_value)):
            if bound is not None and not _positive_number(bound):
                raise ValueError(f"{name} must be None or a number > 0 (inf: no clipping), got {bound!r}")
        sync_clip = float(max_grad_norm) if (max_grad_norm is not None and self.cfg.mode == "sync") else -1.0
        sync_value = float(clip_value) if (clip_value is not None and self.cfg.mode == "sync") else -1.0
        if sync_clip >= 0 and self.topo.others:
            raise ValueError(
                "max_grad_norm in sync mode clips by the global norm, which the shards of a job on several ivyplug "
                "serve processes cannot combine (yet): hold every shard in one service, or clip in async/ssp"
            )
        with self._only(params) as only:
            if clip_value is not None and self.cfg.mode != "sync":
                torch.nn.utils.clip_grad_value_([p for _, p in self.params if p.grad is not None], clip_value)
            clip = 1.0
            if max_grad_norm is not None and self.cfg.mode != "sync":
                grads = [p.grad for _, p in self.params if p.grad is not None]
                if grads:
                    total = torch.nn.utils.get_total_norm(grads)
                    clip = float(torch.clamp(max_grad_norm / (total + 1e-6), max=1.0))
            with self._exclusive("a step"):
                scales = self.cfg.mode != "sync" and (max_grad_norm is not None or clip_value is not None)
                self._step(num_samples, delta, clip, (sync_clip, sync_value), scales, only)

    @contextlib.contextmanager
    def _only(self, params: Collection[torch.Tensor] | None) -> Iterator[set[int] | None]:
        """Hide the gradients of the parameters outside ``params`` (None: none hidden) while a step packs them, and
        write its reply into ``params`` only: the others keep their values and autograd versions until their own
        optimizer's step pulls them, as a torch optimizer leaves the parameters it does not hold."""
        if params is None:
            yield None
            return
        if self.early is not None:
            raise ValueError("a step of some parameters only cannot be combined with overlap_backward=True")
        keep = {id(p) for p in params}
        hidden = [(p, p.grad) for _, p in self.params if id(p) not in keep and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            yield {i for i, (_, p) in enumerate(self.params) if id(p) in keep}
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _step(
        self,
        num_samples: int,
        delta: bool,
        clip: float,
        sync_clips: tuple[float, float],
        scales_pushes: bool,
        only: set[int] | None = None,
    ) -> None:
        """``sync_clips``: (norm, value) the servers clip the combined gradient to, -1 for none; ``scales_pushes``:
        async/ssp clipping edits every push at the step, so nothing is worth sending early; ``only``: the indices
        of the parameters the reply writes (one of several optimizers' step), None: all."""
        early: set[int] = set()
        if self.early is not None:
            early = self.early.take(valid=clip == 1.0)
            self.m.shards_sent_early += len(early)
            self.m.shards_sent_again += len(self.early.stale)
            if self.early.stale:  # sent early, changed since: its send must be done before it is packed again
                self._flush_sends()
        packed = {
            s: self.layout.packed(s) if s in early else self.layout.payload(s, clip, split=ep.segments is not None)
            for s, ep in self.topo.endpoints.items()
        }
        flags = self._check_push(packed) | (PushFlag.DELTA if delta else 0)
        self._push_number += 1
        has_grad = [p.grad is not None for _, p in self.params]
        prefix = hyper_prefix(has_grad, num_samples, flags, self._push_number, *sync_clips)
        self._warn_unmirrored()
        hyper = torch.cat([prefix, self.spec.encode(self.optimizer)])
        with self._servers_named():
            pending = [
                (s, ep.push_pull(self.rank, None if s in early else packed[s], hyper, self._reply_targets(s, only)))
                for s, ep in self.topo.endpoints.items()
            ]
            try:
                staleness, grad_sq = self._collect(pending, only)
            finally:
                if flags & PushFlag.NONFINITE:  # dropped whole: the error it carried (now non-finite) goes too
                    for ep in self.topo.endpoints.values():
                        if isinstance(ep, WireEndpoint) and ep.block is not None:
                            ep.block.reset()
        self.combined_grad_sq_norm = grad_sq if self.cfg.mode == "sync" and math.isfinite(grad_sq) else None
        self.m.pushes += 1
        self.m.pulls += 1
        mark_stepped(self.optimizer)  # the servers stepped this optimizer's mirror: LR schedulers warn otherwise
        if staleness:
            tau_max = max(staleness)
            self.m.staleness_sum += tau_max
            self.m.staleness_max = max(self.m.staleness_max, tau_max)
        self._scales_pushes = scales_pushes
        self._arm_early()

    def _warn_unmirrored(self) -> None:
        """Warn once for each change to the optimizer's groups that no push can carry to the servers."""
        for change in self.spec.unmirrored_changes(self.optimizer):
            if change not in self._unmirrored:
                self._unmirrored.add(change)
                warnings.warn(
                    f"ivyplug PS (rank {self.rank}): {change} after the PS started; the servers keep the value they "
                    "were given (only numeric hyperparameters present at start travel with each push)",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _reply_targets(self, shard: int, only: set[int] | None = None) -> list[torch.Tensor | None] | None:
        """Where shard ``shard``'s reply parts are received in place, when its wire is cut (wire/segments.py)."""
        if self.topo.endpoints[shard].segments is None:
            return None
        return self.layout.reply_targets(shard, only)

    def _arm_early(self) -> None:
        """Let the next backward send early, unless that would only repeat what the step sends anyway."""
        if self.early is None or self._scales_pushes:
            return
        if self.early.wasted:
            warnings.warn(
                f"ivyplug PS (rank {self.rank}): overlap_backward is off from now on: in the last "
                f"{WASTED_STEPS} steps every shard sent from backward's gradient hooks had changed before the "
                "step (gradients edited after backward: in-place clipping, a replaced .grad or a second backward "
                "outside PSClient.hold_pushes()), so each was sent twice. Pass overlap_backward=False to push "
                "at the step without this warning.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.stop_early_pushes()
            return
        self.early.arm()

    def _check_push(self, packed: dict[int, torch.Tensor | list[torch.Tensor]]) -> int:
        """Push flags after checking the whole push (every shard's part) for NaN/Inf, before any is sent.

        Checking here, where the whole push is at hand, makes the policy atomic: every shard gets the same
        flag, so no shard applies part of a push that another drops.
        """
        ranges = self.layout.float_ranges
        # with a bf16 wire, a finite fp32 value that bf16 rounds to Inf is non-finite there too (same pass)
        below = BF16_OVERFLOW if self.cfg.wire_dtype == "bfloat16" else None

        def found(s: int, data: torch.Tensor | list[torch.Tensor], below: float | None) -> bool:
            if isinstance(data, torch.Tensor):
                return nonfinite_in(data, ranges[s], below) is not None
            return nonfinite_in_parts(data, self.layout.segment_starts[s], ranges[s], below) is not None

        if not any(found(s, data, below) for s, data in packed.items()):
            return 0
        if any(found(s, data, None) for s, data in packed.items()):
            name = self.layout.first_nonfinite()
        else:
            name = "a value beyond bfloat16's range (|x| >= 3.3962e38, Inf once sent with wire_dtype='bfloat16')"
        step = self.m.pushes + 1
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

    def sync(self, exact: bool = True) -> None:
        """Collective: let every in-flight push land, then pull the global params and buffers.

        ``exact``: the pull travels in fp32 whatever ``wire_dtype`` says (the model it brings is kept: the end of
        training, a checkpoint); ``False``: in the wire's form, as a step's pull (validation: the model a meeting
        checks, within the wire's rounding of the global one, for a bf16 or int wire's bytes)."""
        self._check_open()
        self.end_epoch()  # a worker waiting for this one's batches must reach the barrier too
        with self._exclusive("sync()"):
            with self._servers_named():
                for ep in self.topo.endpoints.values():
                    ep.idle(self.rank)
            self.workers.barrier("every worker to reach sync()")
            self._pull_all(exact=exact)

    # -- data dispatch and stop signal ----------------------------------------------------------
    def start_epoch(self, epoch: int, num_batches: int, reserved: int = 0) -> None:
        """Collective at the start of an epoch: the batch queue is refilled with ``0..num_batches-1``.

        ``reserved``: the first ``reserved`` indices belong one to each worker (index ``r`` to rank ``r``, which
        trains it without asking: the dispatch loader reserves one per worker, so none ends an epoch
        empty-handed); counted in ``metrics()["batches"]``. If a worker is lost, the indices it had not
        finished, its reserved one included, are handed out again (see ``next_batch``).
        """
        self._check_open()
        check_epoch(num_batches, reserved, self.world_size)
        if self.rank < reserved:
            self.m.batches += 1
        if self.topo.queue is not None:
            self.topo.queue.reset(epoch, num_batches, reserved)
        elif self.topo.link is not None and self.rank == 0:  # the batch queue of an ivyplug serve
            assert self.topo.queue_endpoint is not None
            with self._servers_named():
                request = self.topo.queue_endpoint.request(Kind.EPOCH, arg0=epoch, arg1=num_batches, arg2=reserved)
                request.header(self.cfg.timeout)
        self.epoch = epoch
        self._epoch_ended = False
        self._asked_ahead = None  # (one of a stopped epoch: its answer is drained by the next request)
        self._ask_ahead.start_epoch()
        self.workers.barrier(f"every worker to start epoch {epoch}")

    def next_batch(self, finished: int = 0) -> int | None:
        """The next batch index of the current epoch, or None when the epoch is over.

        ``finished``: how many of the indices this worker got in this epoch (its reserved one first) it has
        trained and pushed; the others go back to the queue if this worker is lost. When the queue is empty
        while another worker still trains an index it could give back, the answer waits for that worker.
        None also once a worker stopped the epoch (:meth:`stop_epoch`).
        """
        self._check_open()
        if self.epoch is None:
            raise RuntimeError("next_batch() before start_epoch(): call start_epoch(epoch, num_batches) first")
        check_count("finished", finished)
        index = self._ask_queue(finished, BatchAsk.NOW)
        if index == WAIT:  # leave the SSP clock first: a worker blocked by its clock may hold what this one waits for
            with self._exclusive("next_batch()"):
                for ep in self.topo.endpoints.values():
                    ep.idle(self.rank)
            index = self._ask_queue(finished, BatchAsk.WAIT)
        if index < 0:
            return None
        self.m.batches += 1
        return index

    def _ask_queue(self, finished: int, ask: int) -> int:
        assert self.epoch is not None
        if self.topo.queue is not None:
            return self._wait_for_batch(self.topo.queue.take(self.rank, self.epoch, finished, ask == BatchAsk.WAIT))
        endpoint = self.topo.queue_endpoint
        assert endpoint is not None
        with self._servers_named():
            request, self._asked_ahead = self._asked_ahead, None
            if request is None or ask != BatchAsk.NOW:
                sent = time.monotonic()
                request = endpoint.request(Kind.NEXT_BATCH, arg0=self.epoch, arg1=finished, arg2=ask)
                index = request.header(self.cfg.timeout).arg0
                if ask == BatchAsk.NOW:
                    self._ask_ahead.answered(sent, time.monotonic())
            else:
                index = request.header(self.cfg.timeout).arg0
            if index >= 0 and self._ask_ahead.enabled:
                # ask for the next index now, while this batch trains (worker/ask_ahead.py): the queue counts it as
                # held, like an index a data loader fetched ahead, so nothing is lost with this worker
                self._asked_ahead = endpoint.request(Kind.NEXT_BATCH, arg0=self.epoch, arg1=finished, arg2=BatchAsk.NOW)
            return index

    def end_epoch(self) -> None:
        """This worker trained every batch it got in the current epoch: a worker waiting for them goes on.

        Called by the dispatch loader after the epoch's last batch, and by ``sync()``; once per epoch.
        """
        self._check_open()
        if self.epoch is None or self._epoch_ended:
            return
        self._epoch_ended = True
        self._asked_ahead = None
        if self.topo.queue is not None:
            self.topo.queue.finish(self.rank, self.epoch)
        elif self.topo.queue_endpoint is not None:
            with self._servers_named():
                request = self.topo.queue_endpoint.request(Kind.NEXT_BATCH, arg0=self.epoch, arg2=BatchAsk.END)
                request.header(self.cfg.timeout)

    def stop_epoch(self) -> None:
        """This worker reached the fit's step limit: the queue hands out no more batches this epoch.

        Every worker's next request for a batch, and every waiting one, gets none: each ends its epoch after
        the batches it holds, so all of them meet at that epoch's end (where the dispatch loader ends the fit).
        """
        self._check_open()
        if self.epoch is None:
            raise RuntimeError("stop_epoch() before start_epoch(): call start_epoch(epoch, num_batches) first")
        self._asked_ahead = None  # its index, if any, is not trained: this worker stops here
        if self.topo.queue is not None:
            self.topo.queue.stop(self.rank, self.epoch)
        else:
            assert self.topo.queue_endpoint is not None
            with self._servers_named():
                request = self.topo.queue_endpoint.request(Kind.NEXT_BATCH, arg0=self.epoch, arg2=BatchAsk.STOP)
                request.header(self.cfg.timeout)

    def _wait_for_batch(self, fut: Future[int]) -> int:
        try:
            return fut.result(timeout=self.cfg.timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"rank {self.rank}: no batch index of epoch {self.epoch} within timeout={self.cfg.timeout} s: the "
                "batch queue waits for another worker to finish the batches it holds, and it did not "
                "(raise timeout= if a batch takes longer)"
            ) from None

    def request_stop(self) -> None:
        """Raise the stop flag on every PS rank (seen by the others at their next reply or query)."""
        self._check_open()
        self.stop.set()
        channel = self.topo.channel
        for r in self.topo.loop_ranks:
            assert channel is not None
            self.m.wire.bytes_sent += channel.send(r, Header(kind=Kind.STOP, sender=self.rank), wait=True)
        for other in self.topo.others:
            self.m.wire.bytes_sent += other.channel.send(0, Header(kind=Kind.STOP, sender=self.rank), wait=True)

    def stop_requested(self) -> bool:
        return self.stop.is_set() or self.m.wire.remote_stop

    # -- checkpoints ----------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        servers = self.plan.num_shards if self.cfg.servers is not None else self.cfg.num_servers
        return checkpoint.job_meta(self.cfg.mode, servers, self.num_workers, self.plan)

    def mismatch(self, state: Any) -> str | None:
        """Why ``state`` (a :meth:`state_dict`) cannot be loaded as it is into this job (None: it can): another
        number of shards or workers, another shard plan. ValueError if it is no PS state of this ivyplug."""
        return checkpoint.mismatch(state, self._meta())

    def state_dict(self) -> dict[str, Any]:
        """Collective: every shard's params, buffers, optimizer state, version and clocks (on every rank)."""
        self._check_open()
        with self._exclusive("state_dict()"):
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        self.workers.barrier("every worker to reach state_dict()")
        if self.topo.local is not None:  # co-located: every worker holds one shard
            blobs = self.workers.share_all(self.topo.local.state())
        else:
            mine = [self.topo.endpoints[s].state() for s in range(self.plan.num_shards)] if self.rank == 0 else []
            blobs = self.workers.share_from_rank0(mine, self.plan.num_shards)
        return checkpoint.make_state(self._meta(), [load_state_bytes(b) for b in blobs])

    def load_state_dict(self, state: dict[str, Any], param_states: dict[int, dict[str, Any]] | None = None) -> None:
        """Collective: restore every shard from :meth:`state_dict` output (given on every rank), then pull.
        ``param_states``: the optimizer's state per parameter, where :meth:`take_param_states` took it out."""
        self._check_open()
        if param_states is not None:
            state = checkpoint.put_param_states(state, param_states, self.plan, self.spec.param_group)
        with self._exclusive("load_state_dict()"):
            self._load_state_dict(state)

    def take_param_states(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """A :meth:`state_dict` without the optimizer's state, and that state per parameter (index into the params
        given to :meth:`start` -> its state as an optimizer stepping the whole tensor in one process holds it):
        what a checkpoint that other strategies, or a plain training loop, resume from keeps. No collective."""
        return checkpoint.take_param_states(state, self.plan, self.spec.param_group)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        shards = checkpoint.shards_to_load(state, self._meta())
        if state["mode"] != self.cfg.mode:
            log.info("ivyplug PS: resuming a %s-mode state in %s mode (clocks restart)", state["mode"], self.cfg.mode)
        self.workers.barrier("every worker to reach load_state_dict()")
        if self.topo.local is not None:
            self.topo.local.load(shards[self.topo.local.shard])
        elif self.rank == 0:
            for s, ep in self.topo.endpoints.items():
                ep.load(shards[s])
        self.workers.barrier("every shard to load its state")
        for ep in self.topo.endpoints.values():  # every value moved: the next pull travels whole
            if isinstance(ep, WireEndpoint) and ep.pulled is not None:
                ep.pulled.forget()
        self._pull_all(exact=True)

    # -- metrics and teardown ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """This worker's PS counters (names without the ``ivy/`` prefix)."""
        m = self.m
        return {
            "pushes": float(m.pushes),
            "pulls": float(m.pulls),
            "staleness_mean": m.staleness_sum / m.pushes if m.pushes else 0.0,
            "staleness_max": float(m.staleness_max),
            "bytes_sent": float(m.wire.bytes_sent),
            "bytes_received": float(m.wire.bytes_received),
            "wait_seconds": m.wire.wait_seconds,
            "batches": float(m.batches),
            "nonfinite_skipped": float(m.nonfinite_skipped),
            "shards_sent_early": float(m.shards_sent_early),
            "shards_sent_again": float(m.shards_sent_again),
        }

    @property
    def lost_ranks(self) -> list[int]:
        """Workers of this job that left it while it ran (servers outside the workers only)."""
        return list(self.workers.lost) if isinstance(self.workers, MemberGroup) else []

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("PSClient is closed")
        local = self.topo.local
        if local is not None and local.error is not None:
            raise PSProtocolError(f"the PS shard on rank {self.rank} failed: {local.error}")

    def close(self) -> None:
        """Stop the server thread/processes (after every peer said BYE) and drop the PS groups. Idempotent."""
        if self.closed:
            return
        with self._exclusive("close()"):
            self._close()

    def abort(self) -> None:
        """Close after this worker failed: no goodbye and no wait for the other ranks, so that the error this worker
        stopped with is the one raised, at once. Its co-located shard fails (a peer's request to it gets an error
        reply naming this rank); the others learn of it then, when this process's connections close (a dead peer),
        or from its silence (an ``ivyplug serve``'s heartbeat bound); its server processes, if any, are killed.
        Idempotent; a later :meth:`close` does nothing."""
        if self.closed:
            return
        self._failed = True
        if self.topo.local is not None:
            self.topo.local.fail(PSProtocolError(f"rank {self.rank} failed and left the PS"))
        # a request in flight on another thread (an overlapped exchange) ends with the failure: not waited for long;
        # without the lock the groups stay to the process's end, since that request uses them
        locked = self._lock.acquire(timeout=min(ABORT_LOCK_WAIT_S, self.cfg.timeout))
        try:
            self._close(keep_groups=not locked)
        finally:
            if locked:
                self._lock.release()

    def _end_processes_and_heartbeats(self) -> None:
        """Kill the server processes still alive and stop the heartbeats: the goodbye is said (or cannot be)."""
        for p in self.topo.server_procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for link in [self.topo.link, *self.topo.others]:
            if link is not None and link.heartbeat is not None:
                link.heartbeat.stop()

    def _close(self, keep_groups: bool = False) -> None:
        """Say goodbye (unless this worker failed or cannot reach the servers), end the server processes and
        heartbeats, destroy the PS groups (``keep_groups``: another thread may still use them)."""
        if self.closed:
            return
        self.closed = True
        self.stop_early_pushes()
        topo, channel = self.topo, self.topo.channel
        if channel is None:
            return
        err: BaseException | None = None
        try:
            if self.unreachable is not None or self._failed:
                # the servers could not be reached (a goodbye would wait on the same link for another timeout), or
                # this worker failed (the others may be waiting on it): either way the goodbye's error would hide
                # the one the worker stopped with
                raise _Unreachable
            if isinstance(self.workers, MemberGroup):  # it meets through the service: before the goodbye
                self.workers.barrier("every rank to close the PS")
            for r in topo.loop_ranks:
                channel.send(r, Header(kind=Kind.BYE, sender=self.rank), wait=True)
            for other in topo.others:
                other.channel.send(0, Header(kind=Kind.BYE, sender=self.rank), wait=True)
            deadline = time.monotonic() + self.cfg.timeout
            for loop in topo.loops:
                loop.join(max(0.1, deadline - time.monotonic()))
            if any(loop.is_alive() for loop in topo.loops):
                byes = sum(loop.byes for loop in topo.loops)
                expected = sum(len(loop.expect_bye) for loop in topo.loops)
                raise PSTimeoutError(
                    f"timed out after {self.cfg.timeout:g} s on rank {self.rank} waiting for the other ranks to "
                    f"close the PS ({byes} of {expected} said goodbye)"
                )
            channel.flush(replies=True)
            if not isinstance(self.workers, MemberGroup):
                self.workers.barrier("every rank to close the PS")
            # a budget of its own: the barrier above waited for the slowest rank's goodbye, after which every server
            # process has all its goodbyes and only has to exit
            deadline = time.monotonic() + self.cfg.timeout
            for p in topo.server_procs:
                p.join(max(0.1, deadline - time.monotonic()))
            alive = [p.name for p in topo.server_procs if p.is_alive()]
            if alive:
                raise PSTimeoutError(f"timed out after {self.cfg.timeout:g} s waiting for {alive} to exit")
        except _Unreachable:
            pass
        except BaseException as exc:
            err = exc
        finally:
            self._end_processes_and_heartbeats()
        if err is not None:
            raise err
        if keep_groups or (self._failed and any(loop.is_alive() for loop in topo.loops)):
            # without a goodbye this rank's server loops still receive on the PS groups (answering with its shard's
            # failure): a group is not destroyed under a receiving thread; they go with the process
            return
        if topo.owns_p2p_group:
            for group in topo.p2p_groups:
                dist.destroy_process_group(group)
        self.workers.close()
        if self._launch_group is not None:
            self._launch_group.close()
        topo.p2p_groups = []
        topo.channel = None
        topo.store = None
