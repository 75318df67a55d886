"""Lightning's launchers, with the PS configuration check run before any worker starts.

``launcher.launch(fn, model, ...)`` is the first place where the whole fit configuration (the
Trainer's callbacks and validation schedule, the LightningModule) is visible in the main process:
the strategy is built before the Trainer has its callbacks, and ``setup`` already runs inside
the workers. Subclassing keeps Lightning's ``isinstance`` checks on the launcher working.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.exceptions import _TunerExitException

log = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 5.0
"""After rank 0 fails under the popen launcher: how long the other ranks get to end on their own before being killed."""


def destroy_default_group() -> None:
    """Destroy torch.distributed's default group, if there is one.

    Lightning destroys it only for NCCL. A gloo group left to the interpreter's teardown aborts the process now
    and then (SIGABRT, "terminate called without an active exception"), after its work succeeded.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _CheckingStrategy(Protocol):
    def check_fit_configuration(self, trainer: Any, model: Any) -> None: ...

    def abort_ps(self) -> None: ...

    @property
    def tolerates_worker_loss(self) -> bool: ...

    @property
    def joined_default_group(self) -> bool: ...


class _LossObserver(threading.Thread):
    """In place of Lightning's ``_ChildProcessObserver``, which kills every rank when one child dies: once every
    rank has joined the default process group, warns once per lost child and leaves the others training (for
    strategies whose job survives a lost worker). A child that dies before that would leave the others waiting for
    it in the rendezvous until the process-group timeout (30 minutes by default), so then it ends every rank, as
    Lightning's observer does."""

    def __init__(self, children: list[subprocess.Popen[Any]], joined: Callable[[], bool], period: float = 2.0) -> None:
        super().__init__(daemon=True, name="ivyplug-child-observer")
        self._children, self._joined, self._period = children, joined, period
        self._main_pid = os.getpid()

    def run(self) -> None:
        reported: set[int] = set()
        while len(reported) < len(self._children):
            time.sleep(self._period)
            for rank, proc in enumerate(self._children, start=1):
                code = proc.poll()
                if code is None or rank in reported:
                    continue
                reported.add(rank)
                if code == 0:
                    continue
                if not self._joined():
                    log.error(
                        "IvyPSStrategy: rank %d (pid %d) ended with code %s before every rank joined the process "
                        "group; ending every rank (a job goes on without a lost worker only once it has started)",
                        rank,
                        proc.pid,
                        code,
                    )
                    self._end_all()
                    return
                log.warning(
                    "IvyPSStrategy: rank %d (pid %d) ended with code %s; the other ranks go on", rank, proc.pid, code
                )

    def _end_all(self) -> None:
        for proc in self._children:
            if proc.poll() is None:
                proc.send_signal(_get_sigkill_signal())
        os.kill(self._main_pid, _get_sigkill_signal())


def _check(strategy: _CheckingStrategy, trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if trainer is None:
        return
    model = args[0] if args else kwargs.get("model")
    strategy.check_fit_configuration(trainer, model)


class CheckedSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """``popen`` / torchrun launcher that validates the fit configuration first."""

    def __init__(self, strategy: _CheckingStrategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ivy_strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _check(self._ivy_strategy, trainer, args, kwargs)
        try:
            if self._ivy_strategy.tolerates_worker_loss and not self.cluster_environment.creates_processes_externally:
                # Lightning's launch, but with an observer that does not end every rank when one dies
                self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
                self._call_children_scripts()
                _LossObserver(self.procs, lambda: self._ivy_strategy.joined_default_group).start()
                _set_num_threads_if_needed(num_processes=self.num_processes)
                return function(*args, **kwargs)
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except _TunerExitException:  # a tuner ending its trial fit on every rank: the others end it too
            raise
        except BaseException:
            # Lightning ends the other ranks only on KeyboardInterrupt; after any other failure of rank 0
            # (e.g. its port is taken) they would wait for it until the process-group timeout
            try:
                self._ivy_strategy.abort_ps()
            except Exception:  # the error to see is the one rank 0 failed with
                log.exception("IvyPSStrategy: rank 0 failed, and leaving the PS then failed too")
            finally:
                self._end_children()
            raise

    def _end_children(self, grace: float = CHILD_EXIT_GRACE_S) -> None:
        """Kill the other ranks, after up to ``grace`` seconds for those already failing to end on their own: rank 0
        often fails *because* another rank did (its shard failed), and killing that rank at once would lose its
        traceback, the user's error."""
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(_get_sigkill_signal())


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    """``spawn`` / ``fork`` launcher that validates the fit configuration first."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _check(self._strategy, trainer, args, kwargs)  # type: ignore[arg-type]
        return super().launch(function, *args, trainer=trainer, **kwargs)
