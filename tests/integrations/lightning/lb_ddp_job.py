"""A 2-process ``ddp`` fit with IvyLoadBalancer, run as a script (Lightning's ddp launcher re-runs it).

Rank 1 sleeps per sample (a slower device), rank 0 fakes an out-of-memory error above a batch size,
and the strategy carries a user's DDP comm hook that counts its calls. Each rank writes what it saw
to ``<out>/rank<r>.json``. Usage: ``python lb_ddp_job.py OUT_DIR [ddp|ivy_ps_sync]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from ivyplug.integrations.lightning import IvyLoadBalancer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

from ivyplug.load import ScriptedProbe  # noqa: E402
from tests.integrations.lightning.lb_models import DigitsMLP, trainer_kwargs  # noqa: E402

USER_HOOK_CALLS = [0]


def counting_allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A user's own hook: torch's mean all-reduce, counting its calls."""
    USER_HOOK_CALLS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


def main(out: Path, strategy_name: str) -> None:
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
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ddp")
