"""``IvyPSStrategy``: Lightning training on the ivyplug parameter server.

A ``DDPStrategy`` subclass, so launching (spawn, popen, torchrun), ranks and the default process
group's collectives (``reduce``/``broadcast``/``barrier`` for ``sync_dist``, ``ModelCheckpoint`` and
``EarlyStopping``) are Lightning's own. What changes:

* no ``DistributedDataParallel`` wrapper: gradients go to the PS, which owns the optimizer. Without the
  wrapper nothing copies rank 0's initial weights, so every rank pulls the servers' copy at setup;
* the module's optimizers are wrapped in ``PSOptimizer`` (ps/worker/optimizer.py): Lightning calls
  ``step(closure)`` as for any optimizer (automatic or manual optimization, its precision plugins), and the
  wrapper runs the closure (forward, backward, before-step hooks), pushes the gradients and pulls fresh
  parameters (``PSClient.step``) instead of stepping the local optimizer, which only carries the
  hyperparameters (so LR schedulers keep working). Several optimizers of one class (a GAN's) share the PS:
  each step pushes its own parameters' gradients;
* norm clipping (``gradient_clip_val``) is not applied locally: the precision plugin's
  ``clip_gradients`` records the requested norm and the PS clips the combined gradient once; in sync mode
  value clipping (``gradient_clip_algorithm="value"``) too, as DDP clamps the averaged gradient (async/ssp
  clamp each push);
* before validation, a checkpoint and the end of fit every rank applies in-flight pushes and pulls
  the global parameters (``PSClient.sync``), so what is validated, saved and returned is the global model
  (validated as the wire brings it: with a bf16 or int ``wire_dtype`` that pull travels as a step's; the
  others in fp32);
* in ``async``/``ssp`` mode a worker draws its batches from a queue shared through the PS (a fast worker
  trains more batches), and no collective runs on the default group per batch: Lightning's per-batch
  SIGTERM broadcast is replaced by a stop flag carried by the PS, on-step ``sync_dist`` stays local, and
  options that need per-step collectives are refused before spawning. Ranks meet at epoch end.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed
from ivyplug.integrations.lightning import registration
from ivyplug.integrations.lightning.dispatch_loader import process_async_loader
from ivyplug.integrations.lightning.elastic_rendezvous import attempt_store, meet
from ivyplug.integrations.lightning.json_collectives import (
    broadcast_typed,
    from_typed_or_refusal,
    refusal_in,
    typed_or_refusal,
)
from ivyplug.integrations.lightning.launchers import (
    CheckedMultiProcessingLauncher,
    destroy_default_group,
)
from ivyplug.integrations.lightning.lightning_internals import (
    init_process_group,
    insert_first,
    install_checked_launcher,
    patch_epoch_loop,
    per_step_collective_problems,
    record_clipping,
    restore_clipping,
    trainer_of,
    unpatch_epoch_loop,
)
from ivyplug.integrations.lightning.ps_metrics import PSMetricsLogger
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning_utilities.core.apply_func import apply_to_collection
from torch.optim import Optimizer
from typing_extensions import override

from ivyplug.localsgd.optimizer_protocol import DeltaExchangingOptimizer
from ivyplug.ps.config import PSConfig
from ivyplug.ps.wire import gloo_net
from ivyplug.ps.worker.checkpoint import NotPerElement
from ivyplug.ps.worker.member_group import MemberGroup, bytes_tensor, tensor_bytes
from ivyplug.ps.worker.optimizer import PSOptimizer, served_optimizer

log = logging.getLogger(__name__)

#: Key of the PS state inside each entry of a checkpoint's ``optimizer_states``.
CHECKPOINT_KEY = "ivyplug_ps"
#: 2: each entry is the optimizer's own state dict as torch writes it (gradient modes: its state per parameter, taken
#: out of the shards), plus the keys below, so that DDP or a plain loop resumes from it; 1: under "worker_optimizer"
CHECKPOINT_FORMAT = 2
#: The first format, still written where the optimizer's state cannot move into the entries (not per element)
WHOLE_PS_FORMAT = 1
#: The keys an entry adds to the optimizer's state dict.
ENTRY_KEYS = ("format", "mode", CHECKPOINT_KEY)
#: Key of every worker's own local-update optimizer state (AsyncLAMB, LocalUpdates), by rank, in that entry.
LOCAL_STATES_KEY = "worker_optimizers"
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def _release_default_group(launcher: Any) -> None:
    """Destroy the default process group when this process is done with it, not between stages.

    Lightning destroys it only for NCCL, and gloo workers abort at exit without it. A spawned worker runs
    one stage and exits, so it destroys the group now. A popen or torchrun rank keeps its process for the
    Trainer's next ``validate``/``test``/``predict``/``fit``, which reuses the group (Lightning initialises
    it once): destroying it here made that next stage rendezvous again on the same port while the other
    rank still held the old store ("Connection refused", or a hang). Those ranks destroy it at exit.
    """
    if isinstance(launcher, CheckedMultiProcessingLauncher):
        destroy_default_group()
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        global _EXIT_HOOK_INSTALLED
        if not _EXIT_HOOK_INSTALLED:
            _EXIT_HOOK_INSTALLED = True
            atexit.register(destroy_default_group)


_EXIT_HOOK_INSTALLED = False


class IvyPSStrategy(DDPStrategy):
    """Parameter-server training for Lightning: ``Trainer(strategy=IvyPSStrategy(mode="async"))``.

    The servers run the module's optimizer on pushed gradients. With :class:`ivyplug.optim.AsyncLAMB` the
    workers step locally instead and exchange deltas every ``sync_every`` steps (the servers run its outer
    SGD); before validation, checkpoints and the end of fit every worker flushes its delta and pulls. With
    ``AsyncLAMB(..., overlap=True)`` (mode ``"async"`` or ``"sync"``) each exchange runs in the background
    while local steps go on; the PS client then holds the optimizer's shadow copies of the parameters and
    buffers (``ps_tensors``), and the time waited for exchanges in flight is logged as
    ``ivy/rank{r}/overlap_wait_s``.

    Args:
        mode: ``"async"`` (default: each push applied on arrival), ``"sync"`` (every worker's gradient of
            a step combined, weighted by its sample count: the same math as DDP) or ``"ssp"``.
        staleness: for ``mode="ssp"``: a worker blocks while it is more than this many steps ahead of the
            slowest live worker. Required for ssp, refused otherwise.
        num_servers: 0 (default) co-locates one shard with every worker; ``k > 0``: rank 0 starts one CPU
            server process holding k shards (for GPU workers). ``num_servers``, ``staleness_scaling``, ``nonfinite`` and
            ``timeout`` left at ``None`` come from ``[tool.ivyplug.ps]`` in the project's pyproject.toml or
            ``IVYPLUG_PS_*`` variables (:mod:`ivyplug.settings`), else the defaults given here.
        staleness_scaling: ``"inverse"`` (default): the server steps a push made ``tau`` updates after its
            worker's pull with learning rate ``lr / (tau + 1)``; ``"none"``: with ``lr`` (async/ssp only).
        nonfinite: ``"skip"`` (default): a worker's push holding a NaN or Inf (gradient, buffer) is dropped
            on every shard, counted as ``ivy/rank{r}/nonfinite_skipped`` and warned about; in sync mode that
            worker counts zero samples in the step. ``"raise"``: the fit stops with an error naming the rank,
            the step and the first non-finite tensor.
        servers: ``"host:port"`` of an ``ivyplug serve`` whose shards this job uses (instead of co-located
            or dedicated servers; also ``IVYPLUG_PS_SERVERS`` or ``servers`` in ``[tool.ivyplug.ps]``). The
            servers outlive the job: a later job of the same model continues from their state.
        token: the secret that ``ivyplug serve`` was started with (default ``$IVYPLUG_TOKEN``; never logged).
        wire_dtype: ``"float32"`` (default) or ``"bfloat16"``: pushes (gradients, AsyncLAMB's deltas with error
            feedback) and pulled parameters cross the wire in bf16, half the bytes; the servers keep fp32
            (also ``IVYPLUG_PS_WIRE_DTYPE`` or ``wire_dtype`` in ``[tool.ivyplug.ps]``). ``"int8"`` /
            ``"int4"``: pushes travel block-quantized with error feedback (about 1/3.9 and 1/7.5 of fp32's
            bytes; made for AsyncLAMB's deltas), pulls in bf16; not with ``overlap_backward``.
        overlap_backward: ``True``: each shard's gradients leave from backward's gradient hooks as soon as
            backward has produced them all (the transfer overlaps the rest of backward, as DDP's buckets
            do); the servers apply a push only at the optimizer step, after the whole push was checked.
            Micro-batches of ``accumulate_grad_batches`` send nothing; a gradient changed after backward is
            sent again, but in-place edits of ``.grad.data`` are not seen. ``False`` (default): push at the
            step (the overlap measured slower with CPU workers, and is unmeasured on GPUs).
        shared_memory: ``True`` (default): a worker and a server on the same host (co-located, dedicated or an
            ``ivyplug serve`` there) keep each fp32 push and its reply in shared memory, and only the headers
            cross gloo (servers on other hosts and CUDA workers stay on gloo; a bf16 or int ``wire_dtype`` too on
            one host, while a job across hosts takes shared memory in fp32 where it can); ``False``: gloo only
            (also ``IVYPLUG_PS_SHARED_MEMORY`` or ``shared_memory`` in ``[tool.ivyplug.ps]``).
        timeout: seconds that any single wait on the PS may take before failing with an error
            (default ``ivyplug.ps.config.DEFAULT_TIMEOUT_S``, 120 s).
        max_shard_bytes: split tensors larger than this row-wise across servers (a split LAMB tensor keeps its
            whole tensor's trust ratio: the servers combine it). ``"auto"`` (default) splits for element-wise
            optimizers (SGD, Adam, AdamW, ...), so shards balance, and for ivyplug's LAMB in sync mode when the
            workers are on more than one host (a whole layer's traffic would cross one host's link); ``None``:
            whole tensors.
        process_group_timeout: timeout of the default process group's collectives (Lightning's ``timeout``).
        start_method: ``"popen"`` (default, like ``strategy="ddp"``), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend: as for Lightning's ``DDPStrategy``.

    Unknown keyword arguments raise ``ValueError`` (``DDPStrategy`` would forward them to
    ``DistributedDataParallel``, which this strategy does not use).
    """

    strategy_name = "ivy_ps"

    def __init__(
        self,
        mode: str = "async",
        staleness: int | None = None,
        num_servers: int | None = None,
        staleness_scaling: str | None = None,
        timeout: float | None = None,
        max_shard_bytes: int | str | None = "auto",
        nonfinite: str | None = None,
        servers: str | None = None,
        token: str | None = None,
        wire_dtype: str | None = None,
        overlap_backward: bool = False,
        shared_memory: bool | None = None,
        *,
        process_group_timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(
                f"IvyPSStrategy got unknown keyword argument(s) {sorted(unknown)}; allowed: mode, staleness, "
                "num_servers, staleness_scaling, timeout, max_shard_bytes, nonfinite, servers, token, wire_dtype, "
                "overlap_backward, shared_memory, process_group_timeout, "
                "start_method, "
                "accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, "
                "process_group_backend"
            )
        # None: [tool.ivyplug.ps] in pyproject.toml / IVYPLUG_PS_* (ivyplug.settings), else the built-in default
        self.ps_config = PSConfig.from_settings(
            "IvyPSStrategy",
            mode=mode,
            staleness=staleness,
            staleness_scaling=staleness_scaling,
            timeout=timeout,
            num_servers=num_servers,
            max_shard_bytes=max_shard_bytes,
            nonfinite=nonfinite,
            servers=servers,
            token=token,
            wire_dtype=wire_dtype,
            overlap_backward=overlap_backward,
            shared_memory=shared_memory,
        )
        if start_method not in START_METHODS:
            raise ValueError(f"IvyPSStrategy.start_method must be one of {START_METHODS}, got {start_method!r}")
        if process_group_timeout is not None and not isinstance(process_group_timeout, timedelta):
            raise ValueError(
                "IvyPSStrategy.process_group_timeout must be a datetime.timedelta or None, "
                f"got {process_group_timeout!r} (the PS wait limit is `timeout`, in seconds)"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self._client: Any = None
        #: every rank has joined the default group (a popen launcher's observer reads it)
        self.joined_default_group = False
        self._samples: list[int] = []  # per optimizer: samples since its last step (sync weights pushes by them)
        self._local_updates: DeltaExchangingOptimizer | None = None  # an optimizer that steps locally (AsyncLAMB)
        self._param_states: dict[int, dict[str, Any]] = {}  # the optimizers' state, from the shards (a save)
        self._portable = True  # the save in progress writes entries DDP reads (format 2)
        self._ps_closed = False  # a PS ran in this fit and is closed: its servers' state is gone
        self._clip_norm: float | None = None
        self._clip_value: float | None = None
        self._in_train_batch = False
        self._final_model_pulled = False  # this fit's end already pulled the global model
        self._warned_local_reduce = False  # once per strategy: on-step sync_dist stays local in async/ssp
        self._metrics_logger: PSMetricsLogger | None = None
        self._lost_ranks: list[int] = []  # workers lost during the last fit (servers outside the workers)
        self._warned_local = False
        self._failed = False  # this run raised (on_exception): teardown closes the PS without a goodbye

    # ------------------------------------------------------------------ configuration
    @property
    def mode(self) -> str:
        return self.ps_config.mode

    @property
    def is_async(self) -> bool:
        """True for ``async`` and ``ssp``: workers run different numbers of batches."""
        return self.ps_config.mode != "sync"

    @property
    def client(self) -> Any:
        """The worker's ``PSClient`` while fitting (``None`` otherwise)."""
        return self._client

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``ivy_ps``, ``ivy_ps_sync`` and ``ivy_ps_ssp`` (Lightning's classmethod protocol)."""
        registration.register_strategies(strategy_registry)

    def _configure_launcher(self) -> None:
        install_checked_launcher(self)

    def check_fit_configuration(self, trainer: Any, model: Any) -> None:
        """Refuse, before any worker starts, a fit this strategy cannot run (``ValueError``)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._refuse_unsupported(trainer, model)
        problems: list[str] = []
        if self.is_async:
            problems += per_step_collective_problems(trainer)
        if problems:
            raise ValueError(
                f"IvyPSStrategy(mode={self.mode!r}) cannot run this fit: "
                + "; ".join(problems)
                + (
                    ". In async/ssp mode workers run different numbers of batches and meet only at epoch end; "
                    "use mode='sync' for per-step collectives."
                    if self.is_async
                    else "."
                )
            )

    def _refuse_unsupported(self, trainer: Any, model: Any) -> None:
        """What no mode of the PS can run (ValueError): loss scaling, a callback that adds param groups, and
        weight averaging that re-estimates BatchNorm statistics."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "IvyPSStrategy does not support loss scaling (precision='16-mixed'); use 'bf16-mixed' or 32"
            )
        from lightning.pytorch.callbacks import BackboneFinetuning

        adding = [type(c).__name__ for c in trainer.callbacks if isinstance(c, BackboneFinetuning)]
        if adding:
            raise ValueError(
                f"IvyPSStrategy cannot run {adding[0]}: it adds the backbone's parameters to the optimizer as a new "
                "param group during the fit, and the servers' copy of the optimizer is fixed when the PS starts. "
                "Put every parameter in the optimizer from the start and freeze the backbone with "
                "requires_grad_(False) until it should train (a parameter without a gradient is not stepped)"
            )
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        swa = any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks)
        if swa and model is not None and StochasticWeightAveraging.pl_module_contains_batch_norm(model):
            raise ValueError(
                "IvyPSStrategy cannot run StochasticWeightAveraging on a model with BatchNorm layers: it copies the "
                "average into the model and re-estimates the BatchNorm statistics in an extra epoch, whose step and "
                "pulls bring the servers' weights back (and whose new statistics tensors the PS no longer reaches). "
                "Average without BatchNorm, or keep an average yourself (torch.optim.swa_utils.AveragedModel) and "
                "update its statistics after the fit with torch.optim.swa_utils.update_bn"
            )

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup_distributed(self) -> None:
        """Lightning's, with a per-attempt store under torchrun, so restarted workers can rejoin the servers."""
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        # gloo binds the interface that reaches the main address unless GLOO_SOCKET_IFNAME says otherwise
        init_process_group(self, self._attempt_store, gloo_net.interface_for(self.cluster_environment.main_address))
        self.joined_default_group = True

    def _attempt_store(self, world_size: int, timeout: timedelta) -> Any:
        """Under torchrun, this attempt's store, once every rank has reached it within the PS's ``timeout``."""
        store = attempt_store(world_size, timeout)
        if store is not None:
            meet(store, world_size, self.global_rank, self.ps_config.timeout)
        return store

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: gradients travel through the PS."""

    def setup(self, trainer: Any) -> None:
        self._failed = False  # (also after a failed run whose teardown did not run)
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._final_model_pulled = False  # (also after a fit that failed between the pull and on_train_end)
        module = self.lightning_module
        assert module is not None
        optimizers = list(self.optimizers)
        if not optimizers:
            raise ValueError("IvyPSStrategy needs an optimizer (configure_optimizers returned none)")
        if len(optimizers) > 1 and any(isinstance(o, DeltaExchangingOptimizer) for o in optimizers):
            raise ValueError(
                "IvyPSStrategy takes local updates (AsyncLAMB, LocalUpdates) as the only optimizer, got "
                f"{len(optimizers)} optimizers"
            )
        if len(optimizers) > 1 and self.ps_config.overlap_backward:
            raise ValueError("overlap_backward=True pushes every gradient at backward: use it with one optimizer")
        self._refuse_unsupported(trainer, module)  # (also where no launcher of ivyplug checked it before spawning)
        from ivyplug.ps import PSClient

        # local updates (AsyncLAMB): the worker steps and pushes deltas itself; the servers run its outer optimizer
        local = optimizers[0] if isinstance(optimizers[0], DeltaExchangingOptimizer) else None
        self._local_updates = local
        params: list[Any] = list(module.named_parameters())
        buffers: list[Any] = list(module.named_buffers())
        ps_tensors = getattr(local, "ps_tensors", None)
        if ps_tensors is not None:  # overlapped exchanges: the client holds shadow copies, never the model's
            params, buffers = ps_tensors(params, buffers)
        served = served_optimizer(optimizers) if local is None else local.outer_optimizer(self.mode, self.world_size)
        self._ps_closed = False
        self._client = PSClient.start(
            self.ps_config,
            params=params,
            buffers=buffers,
            optimizer=served,
            rank=self.global_rank,
            world_size=self.world_size,
        )
        self._client.pull_initial()
        if local is not None:
            local.attach(self._client)
        else:  # the PS takes each optimizer's step; local steps clip locally, as Lightning does
            self._samples = [0] * len(optimizers)
            record_value = self._record_clip_value if self.ps_config.mode == "sync" else None
            record_clipping(self.precision_plugin, self._record_clip_norm, record_value)
            self.optimizers = [
                PSOptimizer(
                    opt,
                    self._client,
                    num_samples=functools.partial(self._take_samples, k),
                    max_grad_norm=self._take_clip_norm,
                    clip_value=self._take_clip_value,
                )
                for k, opt in enumerate(optimizers)
            ]
        # the gathered per-rank PS metrics are identical on every rank: no sync_dist needed
        warnings.filterwarnings("ignore", message=r".*self\.log\('ivy/rank\d+/.*sync_dist=True")
        self._metrics_logger = PSMetricsLogger(self)
        insert_first(trainer, self._metrics_logger)
        if self.is_async:
            self._install_epoch_loop_patches(trainer)

    def _take_samples(self, k: int) -> int:
        """The samples optimizer ``k`` stepped on since its last step (at least 1), counted from zero again."""
        samples, self._samples[k] = max(self._samples[k], 1), 0
        return samples

    def _take_clip_norm(self) -> float | None:
        """The norm the step's closure asked to clip to (``clip_gradients``), if any; forgotten for the next step."""
        norm, self._clip_norm = self._clip_norm, None
        return norm

    def _record_clip_norm(self, norm: float) -> None:
        self._clip_norm = norm

    def _take_clip_value(self) -> float | None:
        """The value the step's closure asked to clamp to (sync mode), if any; forgotten for the next step."""
        value, self._clip_value = self._clip_value, None
        return value

    def _record_clip_value(self, value: float) -> None:
        self._clip_value = value

    def _set_in_train_batch(self, inside: bool) -> None:
        self._in_train_batch = inside

    def _stop_requested(self, received_sigterm: bool) -> bool:
        """Whether any worker received SIGTERM (told to the others through the PS when this one did)."""
        client = self._client
        if client is None:
            return False
        if received_sigterm:
            client.request_stop()
        return bool(client.stop_requested())

    def _install_epoch_loop_patches(self, trainer: Any) -> None:
        """async/ssp: no default-group collective per batch (ranks run different batch counts)."""
        patch_epoch_loop(trainer, self._set_in_train_batch, self._stop_requested)

    def _remove_patches(self, trainer: Any) -> None:
        """Undo the per-fit patches (the Trainer may run validate/test/another fit afterwards)."""
        restore_clipping(self.precision_plugin)
        if trainer is not None:
            unpatch_epoch_loop(trainer)
            if self._metrics_logger is not None and self._metrics_logger in trainer.callbacks:
                trainer.callbacks.remove(self._metrics_logger)
        self._metrics_logger = None
        self._in_train_batch = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The run failed on this rank: :meth:`teardown` leaves the PS at once (``PSClient.abort``), so that the
        error ``fit`` raises is this one, not a goodbye's to ranks that may be waiting on this one."""
        super().on_exception(exception)
        self._failed = True

    def abort_ps(self) -> None:
        """Leave the PS at once, as a failed rank does (``PSClient.abort``). The popen launcher calls it when rank 0
        fails, before ending the other ranks: their requests to this rank's shard then fail with an error naming
        it, and they end on their own, where they would wait on this rank until killed."""
        if self._client is not None:
            self._client.abort()

    def teardown(self) -> None:
        client = self._client
        failed, self._failed = self._failed, False
        if client is not None and client.lost_ranks:
            self._lost_ranks = client.lost_ranks
        self._client = None
        self._ps_closed = self._ps_closed or client is not None
        self._remove_patches(trainer_of(self.lightning_module))
        if any(isinstance(o, PSOptimizer) for o in self.optimizers):  # the module's own optimizers again
            self.optimizers = [o.optimizer if isinstance(o, PSOptimizer) else o for o in self.optimizers]
        detach = getattr(self._local_updates, "detach", None)
        try:
            if detach is not None and client is not None:  # an overlapped exchange still in flight (a failed fit)
                detach()
            if client is not None:
                client.abort() if failed else client.close()
        finally:
            super().teardown()
            _release_default_group(self.launcher)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """async/ssp: the training loader becomes a dispatch loader, which finds the PS client when an epoch starts.

        Lightning may load it before ``setup`` starts the client (``trainer.estimated_stepping_batches`` read in
        ``configure_optimizers``); a training loader that cannot be dispatched is refused, never trained as is.
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = trainer_of(self.lightning_module)
        if self.is_async and trainer is not None:
            return process_async_loader(
                trainer, dataloader, lambda: self._client, rank=self.global_rank, world_size=self.world_size
            )
        return dataloader

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        try:
            size = int(extract_batch_size(batch))
        except Exception:  # a batch Lightning cannot size counts as one sample
            size = 1
        self._samples = [n + size for n in self._samples]

    # ------------------------------------------------------------------ the step
    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """A micro-batch that does not step (``accumulate_grad_batches``): its backward sends nothing early."""
        if self._client is None:
            yield
            return
        with self._client.hold_pushes():
            yield

    # ------------------------------------------------------------------ collectives
    @property
    def tolerates_worker_loss(self) -> bool:
        """async/ssp with servers outside the workers: a worker that dies leaves the fit to the others."""
        return self.is_async and (self.ps_config.num_servers > 0 or self.ps_config.servers is not None)

    def _members(self) -> MemberGroup | None:
        """The live workers' group of the PS (servers outside the workers), while the PS client runs."""
        client = self._client
        group = getattr(client, "workers", None)
        return group if isinstance(group, MemberGroup) else None

    def _after_loss(self, what: str) -> bool:
        """Whether a worker was lost in this job's fit, so the default process group cannot meet any more:
        then collectives outside fit stay local (warned once)."""
        if not self._lost_ranks:
            return False
        if not self._warned_local:
            self._warned_local = True
            log.warning(
                "IvyPSStrategy: rank(s) %s were lost during fit; %s and later collectives stay local to this rank",
                self._lost_ranks,
                what,
            )
        return True

    def gather_by_rank(self, tensor: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every live rank's ``tensor`` (CPU, same shape and dtype on every rank), by rank."""
        members = self._members()
        if members is not None:
            parts = members.gather(tensor_bytes(tensor), "gathering the PS metrics")
            return {r: bytes_tensor(raw, tensor) for r, raw in parts.items()}
        client = self._client
        if self.world_size == 1 and client is not None:  # one worker: its rank, or its slot of an ivyplug serve's job
            return {client.worker: tensor}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and not self._after_loss("gather"):
            parts_list = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(parts_list, tensor)
            return dict(enumerate(parts_list))
        return {self.global_rank: tensor}

    def _refuse_in_async_batch(self, what: str) -> None:
        """A user's collective inside a training batch in async/ssp would wait for workers that are elsewhere
        (Lightning's own per-batch broadcasts, as the tuner's, meet: every rank runs the same steps there)."""
        if self._in_train_batch and self.is_async and self.world_size > 1:
            raise RuntimeError(
                f"IvyPSStrategy(mode={self.mode!r}): {what} inside a training batch would wait for the other "
                "workers, which are not in lockstep (each trains the batches it is handed): do it at the epoch's "
                "end (on_train_epoch_end, validation), or use mode='sync'"
            )

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        members = self._members()
        if members is not None:
            members.barrier(f"Lightning's barrier {args[0]!r}" if args else "Lightning's barrier")
        elif not self._after_loss("a barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` in a typed encoding, never pickle (DDP's broadcast unpickles what a peer sent):
        what Lightning broadcasts (paths, numbers, containers, tensors) fits it; anything else is a ValueError on
        every rank."""
        members = self._members()
        if members is None:
            if self._after_loss("a broadcast") or not torch.distributed.is_initialized():
                return obj
            try:
                value = broadcast_typed(obj, src)
            except ValueError as exc:
                raise ValueError(f"IvyPSStrategy.broadcast: {exc}") from None
        else:
            blob = typed_or_refusal(obj, src) if self.global_rank == src else b""
            parts = members.gather(blob, f"a broadcast from rank {src}")
            if src not in parts:
                raise RuntimeError(f"IvyPSStrategy.broadcast: rank {src} is gone")
            try:
                value = from_typed_or_refusal(parts[src])
            except ValueError as exc:
                raise ValueError(f"IvyPSStrategy.broadcast: {exc}") from None
        if self.global_rank == src:
            return obj
        return apply_to_collection(value, torch.Tensor, lambda t: t.to(self.root_device))

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """On-step ``sync_dist`` stays local in async/ssp (ranks are not in lockstep); epoch-end reduces are real
        (among the live workers when the servers live outside them)."""
        if self._in_train_batch and self.is_async:
            if not self._warned_local_reduce and self.world_size > 1:
                self._warned_local_reduce = True
                rank_zero_warn(
                    f"IvyPSStrategy(mode={self.mode!r}): a reduce inside a training batch (self.log(..., "
                    "sync_dist=True) with on_step=True) is not synchronised: workers are not in lockstep, so each "
                    "logs its own per-step value; values logged with on_epoch=True are reduced across workers at "
                    "the epoch's end"
                )
            return tensor
        members = self._members()
        if members is None or not isinstance(tensor, torch.Tensor):
            if isinstance(tensor, torch.Tensor) and self._after_loss("a reduce"):
                return tensor
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        parts = torch.stack(members.all_gather(tensor.detach().cpu(), "a reduce"))
        op = str(reduce_op).lower()
        if "sum" in op:
            out = parts.sum(0)
        elif "max" in op:
            out = parts.amax(0)
        elif "min" in op:
            out = parts.amin(0)
        else:  # mean / avg
            out = parts.double().mean(0) if not parts.is_floating_point() else parts.mean(0)
        return out.to(device=tensor.device, dtype=tensor.dtype if out.is_floating_point() else out.dtype)

    @override
    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        self._refuse_in_async_batch("an all_gather (self.all_gather)")
        members = self._members()
        if members is None or not isinstance(tensor, torch.Tensor):
            if isinstance(tensor, torch.Tensor) and self._after_loss("an all_gather"):
                return tensor.unsqueeze(0)
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return torch.stack(members.all_gather(tensor.detach().cpu(), "an all_gather")).to(tensor.device)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        members = self._members()
        if members is None:
            return bool(decision) if self._after_loss("a decision") else super().reduce_boolean_decision(decision, all)
        votes = [bool(b[0]) for b in members.gather(bytes([int(bool(decision))]), "a decision").values()]
        return builtins.all(votes) if all else any(votes)

    # ------------------------------------------------------------------ global model at meeting points
    def _sync(self, exact: bool = True) -> None:
        """Every worker meets and pulls the global model (``PSClient.sync``; ``exact=False``: in the wire's form)."""
        if self._client is not None:
            optimizer = self._local_updates
            if optimizer is not None:
                optimizer.flush()  # local progress since the last exchange goes to the servers first
            self._client.sync(exact=exact)
            if optimizer is not None:
                optimizer.reset_snapshot()  # the next delta is measured from the global copy just pulled

    def on_validation_start(self) -> None:
        self._sync(exact=False)  # validation keeps no model: the pull costs a step's bytes (a checkpoint's is exact)
        super().on_validation_start()

    def pull_final_model(self) -> None:
        """The end of training: every worker pulls the global model (once; :class:`PSMetricsLogger` calls this
        before the user's callbacks' ``on_train_end``, this strategy's ``on_train_end`` where it did not run)."""
        if not self._final_model_pulled:
            self._final_model_pulled = True
            self._sync()
            self._share_checkpoint_paths()

    def _share_checkpoint_paths(self) -> None:
        """async/ssp: every rank's ``ModelCheckpoint`` takes rank 0's paths and scores (collective).

        Only rank 0 writes checkpoints, and each rank names them from its own step count, so another rank's
        ``best_model_path``, ``ckpt_path="best"``/``"last"`` would name files that were never written."""
        trainer = trainer_of(self.lightning_module)
        if not self.is_async or self.world_size < 2 or trainer is None:
            return
        for callback in trainer.checkpoint_callbacks:
            state = self.broadcast(callback.state_dict())
            if self.global_rank != 0:
                callback.load_state_dict(state)

    def on_train_end(self) -> None:
        self.pull_final_model()
        self._final_model_pulled = False  # the next fit pulls again
        super().on_train_end()

    def ps_metrics(self) -> dict[str, float]:
        """This worker's PS counters (empty outside fit); with local updates, also its current ``sync_every``."""
        if self._client is None:
            return {}
        metrics = dict(self._client.metrics())
        if self._local_updates is not None:
            metrics["sync_every"] = float(self._local_updates.sync_every)
            if getattr(self._local_updates, "overlap", False):
                metrics["overlap_wait_s"] = float(self._local_updates.overlap_wait_s)  # type: ignore[attr-defined]
        return metrics

    def end_train_epoch(self) -> None:
        """A worker's training epoch ended: ``sync_every="auto"`` chooses its period again from this epoch's times."""
        if self._local_updates is not None:
            self._local_updates.retune_sync_every()

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync()  # the checkpoint holds the global parameters (collective: every rank saves)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Each entry is the optimizer's state dict as torch writes it, so that DDP or a plain loop resumes from it
        too: where the servers step the optimizer, its state per parameter comes from the shards. The first entry
        also holds the rest of the PS state (collective: every rank saves)."""
        state: dict[str, Any]
        if self._client is None:
            state = dict(super().optimizer_state(optimizer))
            if self._ps_closed:  # saved after the fit: the servers' state is gone, the entry holds none of it
                state[CHECKPOINT_KEY] = None
                if optimizer is self.optimizers[0]:
                    log.warning(
                        "IvyPSStrategy: a checkpoint saved after the PS fit ended holds no optimizer state (the "
                        "servers held it): IvyPSStrategy will not resume from it, DDP would with a fresh optimizer; "
                        "save during the fit (ModelCheckpoint) to resume"
                    )
            return state
        own = optimizer.state_dict()
        first = optimizer is self.optimizers[0]
        if first:
            ps_state = self._client.state_dict()
            self._portable = True
            if self._local_updates is None:  # the optimizer's state moves into its entries
                try:
                    ps_state, self._param_states = self._client.take_param_states(ps_state)
                except NotPerElement as exc:
                    self._portable = False
                    log.warning(
                        "IvyPSStrategy: %s; the checkpoint keeps it in the PS state, which DDP cannot read", exc
                    )
        if not self._portable:  # the first format: the PS state whole, the worker's optimizer beside it
            state = {"format": WHOLE_PS_FORMAT, "mode": self.mode, "worker_optimizer": own}
        else:
            state = {**own, "format": CHECKPOINT_FORMAT, "mode": self.mode}
            if isinstance(optimizer, PSOptimizer) and self._local_updates is None:
                index = self._ps_indices(optimizer)
                state["state"] = {k: self._param_states[j] for k, j in enumerate(index) if j in self._param_states}
        if first:
            state[CHECKPOINT_KEY] = ps_state
        if optimizer is self.optimizers[-1]:
            self._param_states = {}
        if optimizer is self._local_updates:  # each worker's local optimizer state is its own: every one is kept
            state[LOCAL_STATES_KEY] = self._gather_local_states(own)
        return state

    def _ps_indices(self, optimizer: PSOptimizer) -> list[int]:
        """The PS's param index of each parameter of ``optimizer``, in the order of its state dict's indices."""
        assert self._client is not None
        where = {id(p): j for j, (_, p) in enumerate(self._client.params)}
        return [where.get(id(p), -1) for group in optimizer.optimizer.param_groups for p in group["params"]]

    def _gather_local_states(self, mine: dict[str, Any]) -> dict[int, Any] | None:
        """Every live worker's local-update optimizer state, by rank, on rank 0 (``None`` elsewhere): only rank 0
        writes the checkpoint. On the PS's worker group (CPU, bounded by the PS ``timeout``), as the PS state's save
        is; typed encoding, never pickle; a state that cannot be encoded fails on every rank."""
        assert self._client is not None
        what = "the workers' local optimizer states"
        blob = typed_or_refusal(mine, self.global_rank, "save")
        group = self._client.workers
        # every rank learns of a refusal (only refusals travel here), then the states go to rank 0 alone
        for raw in group.share_all(blob if refusal_in(blob) is not None else b""):
            reason = refusal_in(raw)
            if reason is not None:
                raise ValueError(f"IvyPSStrategy: cannot save {what}: {reason}")
        parts = group.gather_to_rank0(blob, what)
        if parts is None or self.global_rank != 0:
            return None
        return {rank: from_typed_or_refusal(raw) for rank, raw in parts.items()}

    @staticmethod
    def _check_resumable(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
        states = checkpoint.get("optimizer_states")
        if not states:
            raise ValueError(
                "IvyPSStrategy cannot resume from a weights-only checkpoint: it holds no PS optimizer state "
                "(save with ModelCheckpoint(save_weights_only=False), or load the weights into the model and "
                "start a new fit without ckpt_path)"
            )
        state = states[0]
        if isinstance(state, Mapping) and CHECKPOINT_KEY in state and state[CHECKPOINT_KEY] is None:
            raise ValueError(
                "IvyPSStrategy cannot resume from this checkpoint: it was saved after the PS fit had ended "
                "(trainer.save_checkpoint after fit), when the servers' optimizer state was gone; load its weights "
                "(Model.load_from_checkpoint(path)) and start a new fit, or resume from a checkpoint saved during it"
            )
        if not isinstance(state, Mapping) or not (CHECKPOINT_KEY in state or {"state", "param_groups"} <= set(state)):
            raise ValueError(
                "IvyPSStrategy cannot resume from this checkpoint: optimizer_states[0] is neither IvyPSStrategy's "
                f"(no {CHECKPOINT_KEY!r} entry) nor a torch optimizer's state dict"
            )
        return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Refuse a checkpoint that cannot resume a PS fit before the PS starts (validate/test take any)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = trainer_of(self.lightning_module)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._check_resumable(checkpoint)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        state = self._check_resumable(checkpoint)
        if self._client is None:
            raise RuntimeError("IvyPSStrategy.load_optimizer_state_dict called before the PS client started")
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"this checkpoint holds {len(states)} optimizers' states; the module configures {len(self.optimizers)}"
            )
        for optimizer, entry in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(self._own_optimizer_state(optimizer, entry))
        ps_state = state.get(CHECKPOINT_KEY)
        why = self._client.mismatch(ps_state) if ps_state is not None else None
        if why is not None and state.get("format") != WHOLE_PS_FORMAT:
            # another job's shard plan (their number, the model): the entries resume as another strategy's
            carried = (
                "the local optimizers carry over, the servers' outer optimizer starts afresh"
                if self._local_updates is not None
                else "the optimizer's state per parameter carry over, the servers' version and clocks start afresh"
            )
            rank_zero_warn(
                f"IvyPSStrategy: {why}. It resumes as another strategy's checkpoint: the weights and {carried}"
            )
            ps_state = None
        if (
            self._local_updates is not None or state.get("format") == WHOLE_PS_FORMAT
        ):  # the PS state holds the servers' optimizer
            if ps_state is not None:
                self._client.load_state_dict(ps_state)  # collective; ends with every rank pulling
            else:
                log.info(
                    "IvyPSStrategy: a checkpoint of another strategy: the local optimizer resumes from it, the "
                    "servers' outer optimizer starts afresh"
                )
        else:  # the optimizer's state, per parameter, is in the entries (from the shards, or another strategy's)
            param_states: dict[int, dict[str, Any]] = {}
            for optimizer, entry in zip(self.optimizers, states, strict=True):
                saved = entry["state"]
                for k, j in enumerate(self._ps_indices(cast(PSOptimizer, optimizer))):
                    if j >= 0 and k in saved:
                        param_states[j] = saved[k]
            if ps_state is None:  # another strategy's: the PS started from its weights (restored before setup)
                ps_state, _ = self._client.take_param_states(self._client.state_dict())
            try:
                self._client.load_state_dict(ps_state, param_states)  # (refused alike on every rank, before it meets)
            except NotPerElement as exc:
                raise ValueError(
                    f"IvyPSStrategy cannot resume this checkpoint's optimizer state: {exc}; resume with "
                    "max_shard_bytes=None (whole tensors on the servers)"
                ) from exc
        if self._local_updates is not None:
            self._local_updates.reset_snapshot()

    def _own_optimizer_state(self, optimizer: Optimizer, entry: Mapping[str, Any]) -> Any:
        """This rank's own local-update optimizer state where the checkpoint holds it, else the saved one (rank 0's;
        for optimizers the servers step it holds only hyperparameters, the same on every rank)."""
        if "worker_optimizer" in entry:  # format 1
            saved = entry["worker_optimizer"]
        elif optimizer is self._local_updates:
            saved = {k: v for k, v in entry.items() if k not in (*ENTRY_KEYS, LOCAL_STATES_KEY)}
        else:  # the servers hold the state: the worker's optimizer keeps its hyperparameters only
            return {"state": {}, "param_groups": entry["param_groups"]}
        if optimizer is not self._local_updates:
            return saved
        own = (entry.get(LOCAL_STATES_KEY) or {}).get(self.global_rank)
        if own is not None:
            return own
        if self.global_rank != 0 and CHECKPOINT_KEY in entry:  # (another strategy's: the same on every rank)
            ranks = sorted(entry.get(LOCAL_STATES_KEY) or {})
            log.warning(
                "IvyPSStrategy: the checkpoint holds no local optimizer state of rank %d (%s): it resumes with rank "
                "0's (its moments, for AsyncLAMB or LocalUpdates' inner optimizer, are rank 0's)",
                self.global_rank,
                f"saved by rank(s) {ranks}" if ranks else "written before each rank's was kept",
            )
        return saved
