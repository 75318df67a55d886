"""Keras ``AsyncLAMB``: LAMB with local steps and delta averaging through ivyplug's parameter server.

The twin of :class:`ivyplug.optim.AsyncLAMB`: each worker takes ``sync_every`` local LAMB steps from the
global copy it last pulled, pushes its delta, and the servers merge it with the outer optimizer chosen by
``outer`` (:mod:`ivyplug.localsgd.delta_exchange`; by default ``"average"``: ``x ← x + merge_rate · Δ``, merge_rate 1
in sync mode and 1/num_workers in async/ssp; ``"nesterov"`` and ``"lamb"`` as for the torch AsyncLAMB, built by
the same code).

Keras runs the optimizer inside a compiled train step, so the exchange — Python, torch.distributed — runs in
:class:`AsyncLAMBExchange`, a callback that ``fit`` calls between steps. The workers are separate Keras
processes (for example started by ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``); the callback joins them in a gloo process group, starts the PS with one co-located shard
per worker, and mirrors the model's trainable variables (and float non-trainable ones, as PS buffers) in
CPU torch tensors. Within a worker any tf.distribute strategy may hold the variables: the callback reads
and assigns them in cross-replica context. Without the callback, AsyncLAMB is LAMB.

Every Keras backend: the callback reads and writes the variables through NumPy. On JAX, whose ``fit`` trains
on a state tuple and writes it to the variables only at the epoch's end, the callback first asks the model
to write its state back (``jax_state_sync``), which also makes the next step start from the variables as the
exchange left them.

Where the workers meet: before validation inside ``fit`` (``on_test_begin``) and at the end of ``fit``
every worker flushes its delta and pulls, so validation and the returned model use the global copy. In
sync mode every exchange is a step of all workers together: give them the same steps per epoch. Workers that
join an ``ivyplug serve`` each on their own (``servers=`` without ``WORLD_SIZE``) are jobs of one: they flush and
pull at those points without meeting, so each validates the global copy as the others had pushed it by then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import keras
import numpy as np
from ivyplug.integrations.keras import autoregister as _autoregister
from ivyplug.integrations.keras.lamb import LAMB
from ivyplug.integrations.keras.model_access import inner_optimizer, steps_in_call

from ivyplug.ps.config import PSConfig

log = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="ivyplug")
class AsyncLAMB(LAMB):
    """LAMB (Keras) whose workers average their progress through the PS every ``sync_every`` steps.

    Args: :class:`~ivyplug.integrations.keras.LAMB`'s, plus ``sync_every`` (local steps between two
    exchanges, >= 1, or ``"auto"``: chosen by each worker from its measured step and exchange times, re-chosen
    at every epoch's end; with ``steps_per_execution`` > 1 an exchange waits for the end of the call that
    reaches the period, so periods round up to whole calls; with data that outlasts ``steps_per_epoch``, a
    repeated ``tf.data`` for one, Keras runs an epoch's last call whole while the count stops at
    ``steps_per_epoch``, so the next exchange may come up to ``steps_per_execution - 1`` steps late),
    ``overlap`` (run each exchange in the background while local steps go on; the rule is
    ``ivyplug.localsgd.delta_exchange``'s), ``merge_rate`` (``outer="average"``; ``None``: 1.0 in sync mode,
    1/num_workers in async/ssp) and the outer optimizer's ``outer``, ``outer_lr``, ``outer_momentum``,
    ``outer_momentum_every`` (names, defaults and meaning as for :class:`ivyplug.optim.AsyncLAMB`; ``outer="lamb"``
    clips its trust ratio to ``max_trust_ratio``). The exchange needs :class:`AsyncLAMBExchange` in ``fit``'s
    callbacks.

    Example:
        >>> import keras
        >>> from ivyplug.integrations.keras import AsyncLAMB
        >>> from ivyplug.integrations.keras.async_lamb import AsyncLAMBExchange
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer=AsyncLAMB(learning_rate=1e-2, sync_every=4), loss="mse")
        >>> x, y = keras.random.normal((32, 4), seed=1), keras.random.normal((32, 2), seed=2)
        >>> h = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[AsyncLAMBExchange(mode="async")])
        >>> model.optimizer.get_config()["sync_every"]
        4
    """

    def __init__(
        self,
        *args: Any,
        sync_every: int | str = 4,
        overlap: bool = False,
        merge_rate: float | None = None,
        outer: str = "average",
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_momentum_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Imported here, not at the top: Keras imports this module to register the class (see
        # .autoregister), and ivyplug.localsgd.delta_exchange loads torch.
        from ivyplug.localsgd.delta_exchange import OuterRule, check_merge_rate, check_overlap
        from ivyplug.localsgd.sync_period import check_sync_period

        sync_every = check_sync_period(sync_every)
        overlap = check_overlap(overlap)
        merge_rate = check_merge_rate(merge_rate)
        rule = OuterRule(outer, merge_rate, outer_lr, outer_momentum, outer_momentum_every)  # checked before fit
        super().__init__(*args, **kwargs)
        self.sync_every = sync_every
        self.overlap = overlap
        self.merge_rate = merge_rate
        self.outer = rule.outer
        self.outer_lr = rule.outer_lr
        self.outer_momentum = rule.outer_momentum
        self.outer_momentum_every = rule.outer_momentum_every

    def outer_rule(self) -> Any:
        """The :class:`ivyplug.localsgd.delta_exchange.OuterRule` the servers merge this optimizer's deltas with."""
        from ivyplug.localsgd.delta_exchange import OuterRule

        return OuterRule(
            self.outer,
            self.merge_rate,
            self.outer_lr,
            self.outer_momentum,
            self.outer_momentum_every,
            self.max_trust_ratio,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "sync_every": self.sync_every,
                "overlap": self.overlap,
                "merge_rate": self.merge_rate,
                "outer": self.outer,
                "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum,
                "outer_momentum_every": self.outer_momentum_every,
            }
        )
        return config


class AsyncLAMBExchange(keras.callbacks.Callback):
    """Runs :class:`AsyncLAMB`'s exchanges with the PS during ``fit`` (see the module docstring).

    Args:
        mode, staleness, staleness_scaling, timeout, nonfinite: as for :class:`ivyplug.ps.PSConfig` (checked
            here, before ``fit`` starts); ``staleness_scaling``, ``timeout`` and ``nonfinite`` left at ``None``
            come from ``[tool.ivyplug.ps]`` / ``IVYPLUG_PS_*`` (:mod:`ivyplug.settings`), as for ``IvyPSStrategy``,
            else ``"inverse"``, the PS's default timeout and ``"skip"``. ``timeout`` also bounds the rendezvous of
            the gloo group the callback makes from torchrun's environment. There is no ``num_servers``: one
            co-located shard per worker, or an ``ivyplug serve`` (a project's ``num_servers`` is warned about).
        servers: ``"host:port"`` of an ``ivyplug serve`` (also ``$IVYPLUG_PS_SERVERS``). Each Keras process
            started on its own is then one worker of the servers' job, without torchrun or a process group;
            the servers' ``--workers`` slots set the default merge rate (1/slots in async/ssp).
        token: the secret the servers were started with (default ``$IVYPLUG_TOKEN``).
        wire_dtype: ``"float32"`` (default) or ``"bfloat16"``: deltas (with error feedback) and pulled values
            cross the wire in bf16, half the bytes (also ``IVYPLUG_PS_WIRE_DTYPE``, ``[tool.ivyplug.ps]``);
            ``"int8"`` / ``"int4"``: deltas block-quantized with error feedback, pulls as int8 differences from the
            copy last pulled. The pulls before validation and at the end of ``fit`` are fp32 always (Keras's
            ``ModelCheckpoint`` and ``BackupAndRestore`` save right after validation); the first travels as a step's.
        shared_memory: ``True`` (default): deltas and pulls between workers on one host travel in shared
            memory, only their headers over gloo (with a bf16 or int ``wire_dtype``: in fp32, in a job across
            hosts; on one host the wire stays gloo); ``False``: gloo only (also ``IVYPLUG_PS_SHARED_MEMORY``).

    At each epoch's end it adds this worker's PS counters to ``fit``'s logs under the names the Lightning strategy
    logs them with: ``ivy/rank{r}/<key>`` for every key of :meth:`ivyplug.ps.PSClient.metrics` (``pushes``,
    ``pulls``, ``staleness_mean``, ``bytes_sent``, ``nonfinite_skipped``, ...), the worker's current local steps per
    exchange ``ivy/rank{r}/sync_every`` and, with ``overlap``, ``ivy/rank{r}/overlap_wait_s``. Each Keras process
    logs its own rank's, or, joined to an ``ivyplug serve`` on its own, its slot's (Lightning gathers every
    rank's for rank 0's loggers).
    """

    def __init__(
        self,
        mode: str = "async",
        staleness: int | None = None,
        *,
        staleness_scaling: str | None = None,
        timeout: float | None = None,
        nonfinite: str | None = None,
        servers: str | None = None,
        token: str | None = None,
        wire_dtype: str | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        super().__init__()
        _warn_unused_num_servers()
        self.config = PSConfig.from_settings(
            "AsyncLAMBExchange",
            mode=mode,
            staleness=staleness,
            staleness_scaling=staleness_scaling,
            timeout=timeout,
            nonfinite=nonfinite,
            servers=servers,
            token=token,
            wire_dtype=wire_dtype,
            shared_memory=shared_memory,
        )
        self.client: Any = None
        self._delta: Any = None
        self._variables: list[Any] = []
        self._tensors: list[Any] = []
        self._local = 0  # local steps since the last exchange
        self._chunk_begin = 0  # the first step of the call in progress (steps_per_execution)
        self._period: Any = None  # the current local steps per exchange (ivyplug.localsgd.sync_period.SyncPeriod)
        self._overlap = False
        self._own_group = False
        self._in_fit = False
        #: a failed fit's client was aborted, its server threads still receive on the process group's subgroups:
        #: the group stays to the process's end (destroying it shuts them down under those threads)
        self._loops_left = False

    @property
    def exchanges(self) -> int:
        """Deltas this worker pushed during the last (or current) fit."""
        return self._delta.exchanges if self._delta is not None else 0

    @property
    def discarded_exchanges(self) -> int:
        """Deltas holding a NaN/Inf that the PS dropped whole (``nonfinite="skip"``), as the torch twin counts them."""
        return self._delta.discarded if self._delta is not None else 0

    # -- start and stop ---------------------------------------------------------------------------
    def _join_workers(self) -> int:
        """The number of workers; joins the gloo group from torchrun's environment when there are several."""
        import torch.distributed as dist

        if self.config.servers is not None:  # one worker of an ivyplug serve's job, on its own
            return 1
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise ValueError(
                    f"AsyncLAMBExchange: WORLD_SIZE={world} but {missing} not set; start the workers with torchrun "
                    "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                )
            from ivyplug.ps.wire import gloo_net

            # gloo binds the interface that reaches MASTER_ADDR unless GLOO_SOCKET_IFNAME says otherwise
            with gloo_net.interface_for(os.environ["MASTER_ADDR"]):
                dist.init_process_group("gloo", timeout=timedelta(seconds=self.config.timeout))
            self._own_group = True
        return world

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        from ivyplug.localsgd.delta_exchange import check_overlap_mode

        if self.client is not None:  # Keras calls no callback when fit raises: that fit's client is still open
            log.warning(
                "AsyncLAMBExchange: the previous fit ended with an error; its PS client is closed now, without "
                "waiting for the other workers, before this fit starts"
            )
            self._stop(failed=True)
        optimizer = inner_optimizer(self.model)  # under mixed precision Keras wraps it in a LossScaleOptimizer
        if not isinstance(optimizer, AsyncLAMB):
            raise ValueError(f"AsyncLAMBExchange needs a model compiled with AsyncLAMB, got {type(optimizer).__name__}")
        check_overlap_mode(bool(optimizer.overlap), self.config.mode)  # before any group or server starts
        world = self._join_workers()
        try:
            self._start(optimizer, world)
        except BaseException as exc:
            try:  # a failed start leaves no client, thread or process group behind for the next fit
                self._stop()
            except Exception as cleanup:  # the start's error is the one to see
                note = getattr(exc, "add_note", None)  # Python 3.11+
                if note is not None:
                    note(f"AsyncLAMBExchange: cleaning up after the failed start failed too: {cleanup}")
            raise

    def _start(self, optimizer: AsyncLAMB, world: int) -> None:
        """Mirror the variables, start the PS client over them and pull the global copy."""
        import torch

        from ivyplug.localsgd.delta_exchange import DeltaExchange
        from ivyplug.localsgd.sync_period import SyncPeriod
        from ivyplug.ps import PSClient

        params = list(self.model.trainable_variables)
        buffers = [v for v in self.model.non_trainable_variables if np.issubdtype(np.dtype(v.dtype), np.floating)]
        self._variables = params + buffers
        self._tensors = [torch.tensor(_to_numpy(v)) for v in self._variables]
        named = [(f"{i}:{v.path}", t) for i, (v, t) in enumerate(zip(self._variables, self._tensors, strict=True))]
        self._overlap = bool(getattr(optimizer, "overlap", False))
        self._delta = DeltaExchange(self._tensors[: len(params)], optimizer.merge_rate, overlap=self._overlap)
        averaged_over = world
        if self.config.servers is not None:  # the servers' worker slots (1 if a job of its own sets them)
            from ivyplug.ps.worker.service_link import worker_slots

            averaged_over = worker_slots(self.config) or 1
        outer = self._delta.outer_optimizer(self.config.mode, averaged_over, optimizer.outer_rule())
        # with overlap the client holds shadow copies, which the background exchange writes
        ps_params, ps_buffers = self._delta.ps_tensors(named[: len(params)], named[len(params) :])
        self.client = PSClient.start(self.config, ps_params, ps_buffers, optimizer=outer)
        self.client.pull_initial()  # every worker starts from the servers' copy (worker 0's)
        self._delta.attach(self.client)
        self._write_back()
        self._local = 0
        self._period = SyncPeriod(optimizer.sync_every)
        self._in_fit = True

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.client is None:
            return
        try:
            self._meet()
        finally:
            self._stop()

    def _stop(self, failed: bool = False) -> None:
        """Close the client and drop the process group this callback made, whatever of them exists. ``failed``: the
        fit ended with an error: leave the PS at once (``PSClient.abort``: no goodbye, the others are told) and keep
        the process group to the process's end: the client's server threads may still receive on its subgroups (the
        next fit reuses it)."""
        try:
            if self.client is not None and failed:
                self._loops_left = True
                try:
                    self.client.abort()
                finally:
                    if self._delta is not None:
                        self._delta.close()  # an overlapped exchange in flight ends with the abort
            elif self.client is not None:
                with _same_epochs_hint():  # the others' goodbyes: a worker still training sends none
                    self.client.close()
        finally:
            self.client = None
            self._in_fit = False
            if self._own_group and not self._loops_left:
                import torch.distributed as dist

                self._own_group = False
                dist.destroy_process_group()

    # -- exchanges --------------------------------------------------------------------------------
    def _sync_state(self) -> None:
        """JAX: write the trainer's state to the variables (and make its next step read them); else nothing."""
        sync = getattr(self.model, "jax_state_sync", None)
        if callable(sync):
            sync()

    def _read_in(self) -> None:
        import torch

        self._sync_state()
        with torch.no_grad():
            for v, t in zip(self._variables, self._tensors, strict=True):
                t.copy_(torch.from_numpy(_to_numpy(v)))

    def _write_back(self) -> None:
        self._sync_state()
        for v, t in zip(self._variables, self._tensors, strict=True):
            v.assign(t.numpy().astype(keras.backend.standardize_dtype(v.dtype)))

    def _exchange(self) -> None:
        """Push the delta and continue from the pull (``overlap``: apply the exchange in flight, start this one)."""
        self._read_in()
        self._delta.timed_exchange(self._local, self._period)
        self._local = 0
        self._write_back()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._chunk_begin = batch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.client is None:
            return
        if self._overlap:
            self._delta.raise_failed()  # an exchange that failed in the background stops fit here
        steps = steps_in_call(self.params, self._chunk_begin, batch)  # steps_per_execution > 1: several
        self._local += steps
        self._period.step_ended(steps)
        if self._local >= self._period.value:
            self._exchange()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Choose ``sync_every="auto"``'s period again from this epoch's times; log it (and the overlap wait)."""
        if self.client is None or self._period is None:
            return
        self._period.retune()
        if logs is not None:
            rank = self.client.worker  # its rank, or its slot of an ivyplug serve
            logs.update({f"ivy/rank{rank}/{name}": value for name, value in self.client.metrics().items()})
            logs[f"ivy/rank{rank}/sync_every"] = float(self._period.value)
            if self._overlap:
                logs[f"ivy/rank{rank}/overlap_wait_s"] = float(self._delta.wait_seconds)

    def _meet(self) -> None:
        """Flush this worker's delta, then every worker pulls the global copy, exact (collective): Keras's
        ``ModelCheckpoint``, ``BackupAndRestore`` and ``EarlyStopping`` keep the weights validation saw, with no
        hook to pull again before they do (Lightning's checkpoints pull themselves; its validation's pull travels
        in the wire's form)."""
        if self._overlap:  # the exchange in flight first: its pull plus the steps taken since
            self._read_in()
            self._delta.finish()
            self._write_back()
        if self._local > 0:
            self._exchange()
            if self._overlap:
                self._delta.finish()  # nothing trained since the exchange's write-back: the tensors are current
                self._write_back()
        with _same_epochs_hint():
            self.client.sync()
        self._delta.reset_snapshot()  # overlap: the pulled shadows become the variables' values
        self._write_back()
        self._period.pause()  # what runs next (validation) is no local step

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._in_fit and self.client is not None:  # validation inside fit sees the global model
            self._meet()


@contextlib.contextmanager
def _same_epochs_hint() -> Iterator[None]:
    """A meeting of the workers (``sync()``, the goodbyes at close) that timed out says the likely cause: workers
    that run different epochs. A timeout of the servers' (a push's reply) is left as it is."""
    from ivyplug.ps.wire.transport import PSTimeoutError

    try:
        yield
    except PSTimeoutError as exc:
        raise PSTimeoutError(
            f"{exc}. AsyncLAMBExchange: the workers meet before each validation and at the end of fit, so each "
            "must run the same epochs and validate alike; a worker stopped early (EarlyStopping on a per-worker "
            "metric such as 'loss') leaves the others waiting. Monitor a 'val_' metric instead: validation runs "
            "on the global model, the same on every worker"
        ) from exc


def _warn_unused_num_servers() -> None:
    """The project's ``num_servers`` (for ``IvyPSStrategy``) has no Keras counterpart: say so rather than ignore it."""
    from ivyplug import settings

    num_servers = settings.project_defaults("ps").get("num_servers")
    if num_servers:
        warnings.warn(
            f"AsyncLAMBExchange: the project's num_servers={num_servers} ([tool.ivyplug.ps] or IVYPLUG_PS_NUM_SERVERS) "
            "is not used: the Keras exchange runs one co-located shard per worker, or joins an ivyplug serve "
            "(servers=)",
            RuntimeWarning,
            stacklevel=3,
        )


def _to_numpy(variable: Any) -> np.ndarray:
    """A variable's value as float32 NumPy, on any backend."""
    return np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)


# Keras may have been imported for the first time by this module, before AsyncLAMB existed: the registration
# Keras's import started (see .autoregister) waited for this point.
_autoregister.finish_deferred()
