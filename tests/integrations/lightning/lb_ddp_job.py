"""Every 2-process IvyLoadBalancer fit of the tests, one rank per process (started with ``LOCAL_RANK`` set, as
torchrun would): the imports and the process group are paid once for all fits.

Share fits (``share_fit``, under ``ddp`` and ``ivy_ps`` sync): rank 1 sleeps per sample (a slower device), rank 0
fakes an out-of-memory error above a batch size, and the ddp strategy carries a user's DDP comm hook that counts
its calls; each rank writes what it saw to ``<out>/<strategy>/rank<r>.json``. Goodput fits (``goodput_fits``): the
digits MLP with and without the balancer and with goodput off, rank 0 writing ``<out>/goodput/<fit>.json``.
The ddp fits run first, then the ivy_ps ones. Usage: ``python lb_ddp_job.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from ivyplug.integrations.lightning import IvyLoadBalancer  # noqa: E402
from ivyplug.integrations.lightning.launchers import destroy_default_group  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

from ivyplug.load import ScriptedProbe  # noqa: E402
from tests.integrations.lightning.lb_models import DigitsMLP, trainer_kwargs  # noqa: E402

USER_HOOK_CALLS = [0]


def counting_allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A user's own hook: torch's mean all-reduce, counting its calls."""
    USER_HOOK_CALLS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


TARGET = 0.97
EPOCHS = {"ddp": 12, "ivy_ps_sync": 12}
FITS = ("ddp/none", "ddp/goodput", "ddp/utilisation", "ivy_ps_sync/none", "ivy_ps_sync/goodput")
TRAIN = 1024  # 16 steps of 64; the other 773 samples validate (1 sample = 0.13 points)


def share_fit(out: Path, strategy_name: str) -> None:
    pl.seed_everything(0, verbose=False)
    USER_HOOK_CALLS[0] = 0
    model = DigitsMLP(batch_size=32, n=384, optimizer="sgd", lr=0.05, oom_above=48, sleep_per_sample=0.003)
    model.oom_rank = 0
    cb = IvyLoadBalancer(
        probes=[ScriptedProbe([{"cpu_util": 50.0, "mem_used": 7.0, "mem_total": 10.0}])],
        interval=0.1,
        adapt_batch_size=False,
        log_every_n_steps=4,
    )
    if strategy_name == "ivy_ps_sync":  # the PS weights each rank's gradient by its sample count itself
        from ivyplug.integrations.lightning import IvyPSStrategy

        strategy: Any = IvyPSStrategy(mode="sync", timeout=120)
    else:
        strategy = DDPStrategy(ddp_comm_hook=counting_allreduce_hook, process_group_backend="gloo")
    trainer = pl.Trainer(strategy=strategy, callbacks=[cb], **trainer_kwargs(devices=2, max_epochs=3))
    trainer.fit(model)
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "strategy": strategy_name,
        "history": cb.history,
        "shares": cb.shares,
        "seen": model.seen,
        "batch_sizes": model.batch_sizes,
        "oom_count": cb.oom_count,
        "user_hook_calls": USER_HOOK_CALLS[0],
        "share_hook_calls": cb._hook_state.calls if cb._hook_state is not None else 0,
        "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
        "logged": sorted(cb.metrics),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def goodput_fits(out: Path, strategy_names: tuple[str, ...]) -> None:
    """The goodput fits of ``strategy_names``, each writing what rank 0 saw to ``out/<strategy>_<balancer>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    from ivyplug.integrations.lightning import IvyPSStrategy
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(3))  # the last writers are not held out
    xt, yt = torch.tensor(x / 16.0, dtype=torch.float32)[order], torch.tensor(y, dtype=torch.long)[order]
    train, val = TensorDataset(xt[:TRAIN], yt[:TRAIN]), TensorDataset(xt[TRAIN:], yt[TRAIN:])

    class Digits(pl.LightningModule):
        def __init__(self, epochs: int) -> None:
            super().__init__()
            self.epochs = epochs
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
            self.curve: list[dict[str, float]] = []
            self.t0 = 0.0
            self.samples = 0

        def train_dataloader(self) -> DataLoader:
            return DataLoader(train, batch_size=32, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(val, batch_size=len(val))

        def on_fit_start(self) -> None:
            self.t0 = time.perf_counter()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.samples += len(batch[0])
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            acc = (self.net(batch[0]).argmax(1) == batch[1]).float().mean().item()
            point = {"epoch": self.current_epoch, "acc": acc, "steps": self.global_step}
            self.curve.append({**point, "seconds": time.perf_counter() - self.t0, "samples": self.samples})

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)  # annealed: the last epochs settle
            return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)]

    idle = {"cpu_util": 20.0, "mem_used": 3.0, "mem_total": 10.0}
    for fit in FITS:
        strategy_name, balancer = fit.split("/")
        if strategy_name not in strategy_names:
            continue
        pl.seed_everything(0, verbose=False)
        strategy: Any = (
            IvyPSStrategy(mode="sync", timeout=120)
            if strategy_name == "ivy_ps_sync"
            else DDPStrategy(process_group_backend="gloo")
        )
        callbacks: list[Any] = []
        cb = None
        if balancer != "none":
            cb = IvyLoadBalancer(probes=[ScriptedProbe([idle])], interval=0.05, goodput=balancer == "goodput")
            callbacks.append(cb)
        model = Digits(EPOCHS[strategy_name])
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=EPOCHS[strategy_name],
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model)
        if trainer.global_rank == 0:
            result = {
                "curve": model.curve,
                "history": [] if cb is None else [{k: v for k, v in h.items() if k != "ranks"} for h in cb.history],
                "goodput_unavailable": None if cb is None else cb.goodput_unavailable,
            }
            (out / f"{strategy_name}_{balancer}.json").write_text(json.dumps(result))


def main(out: Path) -> None:
    for strategy_name in ("ddp", "ivy_ps_sync"):  # ddp first: its fits share the default process group
        share_fit(out / strategy_name, strategy_name)
        goodput_fits(out / "goodput", (strategy_name,))
    destroy_default_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
