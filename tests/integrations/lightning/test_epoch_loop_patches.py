"""async/ssp: the per-batch SIGTERM broadcast is replaced by the PS stop flag; on-step reduces stay local."""

from __future__ import annotations

import warnings

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException


class StopFlagClient:
    """Test double for the two stop-signal calls of PSClient."""

    def __init__(self) -> None:
        self.local = False
        self.remote = False

    def request_stop(self) -> None:
        self.local = True

    def stop_requested(self) -> bool:
        return self.local or self.remote


def _patched(mode: str, install: bool = True) -> tuple[Trainer, IvyPSStrategy, StopFlagClient]:
    strategy = IvyPSStrategy(mode=mode, staleness=2 if mode == "ssp" else None)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    client = StopFlagClient()
    strategy._client = client
    if install:
        strategy._install_epoch_loop_patches(trainer)
    return trainer, strategy, client


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_sigterm_travels_through_the_ps_not_a_broadcast(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, _, client = _patched(mode)
    loop = trainer.fit_loop.epoch_loop

    def no_collectives(*args: object, **kwargs: object) -> None:
        raise AssertionError("a default-group collective ran per batch")

    monkeypatch.setattr(torch.distributed, "broadcast", no_collectives)
    monkeypatch.setattr(torch.distributed, "barrier", no_collectives)
    loop._broadcast_sigterm_tensor()  # nothing pending: returns
    client.remote = True  # another worker got SIGTERM
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()
    client.remote = False
    trainer._signal_connector.received_sigterm = True  # this worker got SIGTERM: tell the others through the PS
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()
    assert client.local


def test_on_step_reduce_is_local_only_inside_a_training_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, strategy, _ = _patched("async", install=False)
    calls: list[str] = []
    monkeypatch.setattr(
        "lightning.pytorch.strategies.ddp._sync_ddp_if_available",
        lambda tensor, group, reduce_op: calls.append("all_reduce") or tensor * 2,
    )
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(
        type(trainer.fit_loop.epoch_loop),
        "advance",
        lambda self, data_fetcher: seen.append(strategy.reduce(torch.tensor(3.0))),
    )
    strategy._install_epoch_loop_patches(trainer)  # wraps the (stand-in) advance of this loop
    with pytest.warns(UserWarning, match=r"sync_dist=True\) with on_step=True\) is not synchronised"):
        trainer.fit_loop.epoch_loop.advance(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every batch
        trainer.fit_loop.epoch_loop.advance(None)
    assert seen == [torch.tensor(3.0)] * 2 and calls == []  # inside a batch: local
    assert strategy.reduce(torch.tensor(3.0)) == torch.tensor(6.0) and calls == ["all_reduce"]  # epoch end: real
