"""One popen-launched 2-rank job running several digits fits in sequence (one launch: start-up paid once).

Each argument after the output folder names a fit ``kind/mode/outer/wire/epochs``: ``kind`` ``local`` (SGD in
``LocalUpdates`` with ``sync_every=16``, merged by the outer optimizer ``outer``; ``outer@lr@momentum`` set its
``outer_lr`` and ``outer_momentum``), ``auto`` (the same with ``sync_every="auto"`` and rank 1 sleeping 20 ms a
step) or ``grad`` (the servers run the optimizer ``outer`` names, ``sgd`` or
``lamb``, on pushed gradients); ``wire`` is a ``wire_dtype``. Each rank writes one JSON file per fit: the
final validation accuracy and this rank's PS traffic.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repository's tests package
from tests.integrations.lightning.digits import DigitsMLP

SYNC_EVERY = 16


class AveragingMLP(DigitsMLP):
    """The digits MLP with SGD in LocalUpdates (local steps, a delta merged by ``outer`` every 16 steps)."""

    def __init__(
        self,
        outer: str,
        outer_lr: float | None,
        outer_momentum: float | None,
        sync_every: int | str = SYNC_EVERY,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.outer, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self.sync_every = sync_every

    def configure_optimizers(self) -> Any:
        from ivyplug.optim import LocalUpdates

        inner = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return LocalUpdates(
            inner,
            sync_every=self.sync_every,  # type: ignore[arg-type]
            outer=self.outer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
        )


def run(spec: str) -> dict[str, Any]:
    kind, mode, outer, wire, epochs = spec.split("/")
    outer, _, outer_lr = outer.partition("@")
    outer_lr, _, momentum = outer_lr.partition("@")
    inner_lr = float(os.environ.get("INNER_LR", "0.1"))
    seed_everything(0)
    if kind in ("local", "auto"):
        lr_out = float(outer_lr) if outer_lr else None
        beta = float(momentum) if momentum else None  # None: LocalUpdates' own default
        slow = {"sync_every": "auto", "slow_rank": 1, "delay_s": 0.02} if kind == "auto" else {}
        model: DigitsMLP = AveragingMLP(
            outer, lr_out, beta, hidden=64, lr=inner_lr, batch_size=32, shuffle=True, **slow
        )
    else:
        lr = 0.1 if outer == "sgd" else 2e-2
        model = DigitsMLP(hidden=64, lr=lr, optimizer=outer, batch_size=32, shuffle=True)
    strategy = IvyPSStrategy(mode=mode, timeout=60, wire_dtype=wire, process_group_timeout=timedelta(seconds=60))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=int(epochs),
        check_val_every_n_epoch=int(epochs),  # validate once, at the end: no meeting point before
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    metrics = trainer.callback_metrics
    rank = trainer.global_rank
    return {
        "spec": spec,
        "rank": rank,
        "val_acc": float(metrics["val_acc"]),
        "bytes_sent": float(metrics[f"ivy/rank{rank}/bytes_sent"]),
        "bytes_received": float(metrics[f"ivy/rank{rank}/bytes_received"]),
        "pushes": float(metrics[f"ivy/rank{rank}/pushes"]),
        # every rank's current local steps per exchange (local updates only), as logged
        "sync_every": [
            float(metrics[f"ivy/rank{r}/sync_every"]) for r in (0, 1) if f"ivy/rank{r}/sync_every" in metrics
        ],
    }


def main() -> None:
    out = Path(sys.argv[1])
    for i, spec in enumerate(sys.argv[2:]):
        result = run(spec)
        (out / f"fit{i}-rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
