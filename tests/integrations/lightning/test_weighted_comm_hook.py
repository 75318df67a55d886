"""The share-weighted DDP hook gives the full-batch mean gradient for uneven per-rank batches."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
from pathlib import Path

import torch
from ivyplug.integrations.lightning.weighted_comm_hook import ShareHookState, share_weighted_hook

from tests.ports import free_port

SIZES = (7, 2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SIZES), 5, generator=g), torch.randint(0, 3, (sum(SIZES),), generator=g)


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    models: list[torch.nn.Module] = []
    try:
        x, y = _data()
        start = sum(SIZES[:rank])
        xs, ys = x[start : start + SIZES[rank]], y[start : start + SIZES[rank]]
        grads = {}
        for compose in (False, True):  # one hook per model: a second model for the composed hook
            models.append(torch.nn.parallel.DistributedDataParallel(_model()))
            model = models[-1]
            state = ShareHookState(world_size=2, weight=SIZES[rank] / sum(SIZES))
            if compose:
                state.user_hook, state.user_state = default_hooks.allreduce_hook, None
            model.register_comm_hook(state, share_weighted_hook)
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            grads[compose] = [p.grad.clone() for p in model.parameters()]
            assert state.calls > 0 and state.last_bucket_time is not None
            del model
        torch.save(grads, out)
    finally:
        # the DDP reducers hold the process group: end them before it, not at interpreter exit (one CI run
        # saw a worker abort after its results were saved, "terminate called without an active exception")
        models.clear()
        gc.collect()
        dist.destroy_process_group()


def test_uneven_shares_give_the_full_batch_gradient(tmp_path: Path) -> None:
    model = _model().double()
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x.double()), y).backward()
    reference = [p.grad for p in model.parameters()]
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path / f"{r}.pt"))) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
            assert p.exitcode == 0, f"worker exit code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for r in (0, 1):
        grads = torch.load(tmp_path / f"{r}.pt")
        for compose in (False, True):
            for g, ref in zip(grads[compose], reference, strict=True):
                torch.testing.assert_close(g.double(), ref, rtol=1e-5, atol=1e-6)
