"""One node of a two-node Lightning job on the digits MLP, started by torchrun on each emulated host.

``torchrun --nnodes 2 --node-rank I ... lightning_job.py OUT_DIR --strategy ddp|ivy_ps_sync|ivy_ps_async``
trains 2 epochs (SGD with momentum, or ``--optimizer lamb``; gradient clipping 0.5) and writes each rank's
parameters to ``OUT_DIR/rank{r}.pt`` (its initial ones to ``init{r}.pt``, the tensors the PS split across its
shards to ``split{r}.txt``, the ``ivy/`` metrics each rank logged to ``metrics{r}.json``; ``--wire``: the
``wire_dtype``); it prints ``rank R batch N`` after every batch,
and ``--sleep`` slows every batch by that many seconds (``--hold FILE``: the first epoch's 4th batch waits
for FILE, so that a test can act while every worker is at a known point). ``--nodes 1 --servers HOST:PORT``:
one worker of an ``ivyplug serve``, started on its own; an error that ends ``fit`` is printed as
``error after S s: ...`` (exit 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="ivy_ps_sync")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--hold", default=None, help="after its 4th batch, wait (up to 120 s) until this file exists")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--nodes", type=int, default=2, help="1: a single worker, started without torchrun")
    ap.add_argument("--servers", default=None, help="host:port of an ivyplug serve (token: $IVYPLUG_TOKEN)")
    ap.add_argument("--num-servers", type=int, default=0, help="dedicated server processes started by rank 0")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "lamb"))
    ap.add_argument("--wire", default="float32", help="PSConfig.wire_dtype")
    args = ap.parse_args()
    import torch
    from ivyplug.integrations.lightning import IvyPSStrategy
    from ivyplug.integrations.lightning.launchers import destroy_default_group
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests.integrations.lightning.digits import DigitsMLP

    torch.set_num_threads(1)

    class Progress(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            client = getattr(trainer.strategy, "client", None)
            if client is not None:
                Path(args.out, f"split{trainer.global_rank}.txt").write_text(" ".join(client.plan.split_tensors()))

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            print(f"rank {trainer.global_rank} batch {batch_idx}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if args.hold and trainer.current_epoch == 0 and batch_idx == 3:
                print(f"rank {trainer.global_rank} holding", flush=True)
                deadline = time.monotonic() + 120
                while not Path(args.hold).exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{args.hold} did not appear within 120 s")
                    time.sleep(0.05)

    seed_everything(0)
    model = DigitsMLP(hidden=64, lr=0.1 if args.optimizer == "sgd" else 0.01, optimizer=args.optimizer, batch_size=32)
    rank = int(os.environ.get("RANK", "0"))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(args.out) / f"init{rank}.pt")
    strategy: Any = args.strategy
    if args.strategy.startswith("ivy_ps_"):
        mode = args.strategy.removeprefix("ivy_ps_")
        strategy = IvyPSStrategy(
            mode=mode, timeout=args.timeout, servers=args.servers, num_servers=args.num_servers, wire_dtype=args.wire
        )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        num_nodes=args.nodes,
        max_epochs=args.epochs,
        gradient_clip_val=0.5,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Progress()],
    )
    t0 = time.monotonic()
    try:
        trainer.fit(model)
    except Exception as exc:
        print(f"error after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        return 3
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(args.out) / f"rank{rank}.pt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("ivy/")}
    (Path(args.out) / f"metrics{rank}.json").write_text(json.dumps(metrics))
    print(f"rank {rank} done", flush=True)
    destroy_default_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
