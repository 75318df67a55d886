"""One popen-launched job (2 ranks) running every Trainer stage on one Trainer per PS configuration.

For each (mode, num_servers or the address of an ``ivyplug serve``): ``validate`` before ``fit``, ``fit``,
then ``validate``, ``test``, ``predict`` and a second ``fit`` with a larger ``max_epochs`` on the same
Trainer, with Lightning's own ``BoringModel``. Each rank writes one JSON file per configuration into the
folder named first on the command line (printed lines of two ranks may interleave): the stages that ran,
the global step after each fit and a checksum of its parameters (equal on both ranks: the global model), and
what two broadcasts from rank 0 gave: one of the values Lightning broadcasts, and one that only pickle could
carry (which must fail on every rank, never be unpickled).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

MODES = {"ivy_ps": "async", "ivy_ps_sync": "sync", "ivy_ps_ssp": "ssp"}


def run(name: str, servers: str) -> dict[str, object]:
    """``servers``: a number of dedicated servers, or the address of an ``ivyplug serve``."""
    seed_everything(0)
    mode = MODES[name]
    where = {"num_servers": int(servers)} if servers.isdigit() else {"servers": servers}
    strategy = IvyPSStrategy(mode=mode, staleness=2 if mode == "ssp" else None, timeout=60, **where)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=8,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
    )
    model = BoringModel()
    in_fit = BroadcastInFit()
    trainer.callbacks.append(in_fit)
    done: list[str] = []
    steps: list[int] = []
    trainer.validate(model)
    done.append("validate")
    trainer.fit(model)
    done.append("fit")
    steps.append(trainer.global_step)
    for stage in ("validate", "test", "predict"):
        getattr(trainer, stage)(model)
        done.append(stage)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model)
    done.append("fit")
    steps.append(trainer.global_step)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    broadcast, refused = broadcasts(trainer)
    return {
        "config": f"{name}/{servers}",
        "rank": trainer.global_rank,
        "stages": done,
        "steps": steps,
        "checksum": checksum,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "broadcast": broadcast,
        "refused": refused,
        "in_fit": in_fit.seen,
    }


def broadcasts(trainer: Trainer) -> tuple[dict[str, object], str]:
    """What rank 0's value arrives as, and the error a value only pickle carries raises, on this rank."""
    rank = trainer.global_rank
    sent = {"path": Path(f"/runs/{rank}/last.ckpt"), "epoch": 2 + rank, "t": torch.arange(3) + rank}
    got = trainer.strategy.broadcast(sent)
    broadcast = {k: v.tolist() if isinstance(v, torch.Tensor) else repr(v) for k, v in got.items()}
    try:
        trainer.strategy.broadcast(Unpicklable(rank))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return broadcast, refused


class BroadcastInFit(Callback):
    """The same two broadcasts at the end of a fit's first epoch (through the PS's worker group where it has
    one: servers outside the workers)."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: object) -> None:
        if not self.seen:
            self.seen = list(broadcasts(trainer))


class Unpicklable:
    """A value pickle would carry across (and run code to rebuild); the strategy's broadcast must refuse it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def main() -> None:
    out = Path(sys.argv[1])
    for item in sys.argv[2:]:
        name, servers = item.split("/")
        result = run(name, servers)
        tag = servers if servers.isdigit() else "serve"
        (out / f"{name}-{tag}-rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
