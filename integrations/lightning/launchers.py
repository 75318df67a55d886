"""Lightning's launchers, with the PS configuration check run before any worker starts.

``launcher.launch(fn, model, ...)`` is the first place where the whole fit configuration (the
Trainer's callbacks and validation schedule, the LightningModule) is visible in the main process:
the strategy is built before the Trainer has its callbacks, and ``setup`` already runs inside
the workers. Subclassing keeps Lightning's ``isinstance`` checks on the launcher working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal


class _CheckingStrategy(Protocol):
    def check_fit_configuration(self, trainer: Any, model: Any) -> None: ...


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
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            # Lightning ends the other ranks only on KeyboardInterrupt; after any other failure of rank 0
            # (e.g. its port is taken) they would wait for it until the process-group timeout
            self.kill(_get_sigkill_signal())
            raise


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    """``spawn`` / ``fork`` launcher that validates the fit configuration first."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _check(self._strategy, trainer, args, kwargs)  # type: ignore[arg-type]
        return super().launch(function, *args, trainer=trainer, **kwargs)
