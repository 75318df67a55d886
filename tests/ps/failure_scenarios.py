"""Processes that fail on purpose: a co-located peer killed mid-job, a dedicated-server job whose rank 0 dies."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def killed_peer(rank: int, world: int, port: int, mode: str, timeout: float, outfile: str) -> None:
    """Rank ``world-1`` SIGKILLs itself after start; rank 0 steps as Lightning would, then tears down.

    Rank 0 writes what its step and close raised (type, message, seconds) to ``outfile`` and returns
    normally: the test checks that the process then exits by itself (the server thread is a daemon).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, opt = _model()
    client = PSClient.start(PSConfig(mode=mode, timeout=timeout), list(model.named_parameters()), [], opt)
    client.pull_initial()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the peer is gone by now
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    torch.nn.functional.mse_loss(model(x), y).backward()
    out: dict[str, Any] = {}
    for what, call in (("step", lambda: client.step(4)), ("close", client.close)):
        t0 = time.monotonic()
        try:
            call()
            out[what] = {"error": None, "type": None, "seconds": time.monotonic() - t0}
        except Exception as exc:
            out[what] = {"error": str(exc), "type": type(exc).__name__, "seconds": time.monotonic() - t0}
    t0 = time.monotonic()
    dist.destroy_process_group()
    out["destroy_seconds"] = time.monotonic() - t0
    torch.save(out, outfile)
    print(f"[rank {rank}] results written", file=sys.stderr, flush=True)


def dedicated_job() -> None:
    """Rank 0 of a one-worker job with one dedicated server, for the parent-watchdog test.

    First a push the server refuses (3 gradient values for a shard of more): its error reply must come at
    once, not after ``timeout``. Then print the server's pid and wait to be killed.
    """
    model, opt = _model()
    # over gloo: a shared-memory endpoint refuses a push of the wrong size itself, before anything is sent
    cfg = PSConfig(mode="sync", num_servers=1, timeout=60.0, shared_memory=False)
    client = PSClient.start(cfg, list(model.named_parameters()), [], opt)
    client.pull_initial()
    hyper = torch.cat([torch.tensor([-1.0, 4.0], dtype=torch.float64), client.spec.encode(opt)])
    t0 = time.monotonic()
    try:  # straight to dedicated server 0's wire endpoint: 3 gradient values for a shard of more
        client.topo.endpoints[0].push_pull(client.rank, torch.zeros(3), hyper).result(60.0)
        result: dict[str, Any] = {"type": None, "error": None}
    except Exception as exc:
        result = {"type": type(exc).__name__, "error": str(exc)}
    result["seconds"] = time.monotonic() - t0
    print("ERROR_REPLY " + json.dumps(result), flush=True)
    print("SERVERS " + " ".join(str(p.pid) for p in client.server_procs), flush=True)
    time.sleep(300)


def parked_push_refused(rank: int, world: int) -> dict[str, Any]:
    """sync, 2 workers, one dedicated server. Rank 1's push is parked (waiting for rank 0's); rank 0 then
    sends a push the server refuses, which fails the shard: rank 1 must get an error reply at once (over
    gloo: a shared-memory endpoint refuses a push of the wrong size itself, before anything is sent)."""
    model, opt = _model()
    cfg = PSConfig(mode="sync", num_servers=1, timeout=30.0, shared_memory=False)
    client = PSClient.start(cfg, list(model.named_parameters()), [], opt)
    client.pull_initial()
    dist.barrier()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    if rank == 1:
        torch.nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        try:
            client.step(4)
            out.update(type=None, error=None)
        except Exception as exc:
            out.update(type=type(exc).__name__, error=str(exc))
    else:
        time.sleep(1.0)  # rank 1's push is parked by now
        hyper = torch.cat([torch.tensor([-1.0, 4.0], dtype=torch.float64), client.spec.encode(opt)])
        try:
            client.topo.endpoints[0].push_pull(client.rank, torch.zeros(3), hyper).result(30.0)
        except Exception as exc:
            out.update(type=type(exc).__name__, error=str(exc))
    out["seconds"] = time.monotonic() - t0
    return out


def dedicated_job_without_close() -> None:
    """Rank 0 of a one-worker job with one dedicated server raises before close(): it must still exit."""
    model, opt = _model()
    client = PSClient.start(PSConfig(mode="sync", num_servers=1, timeout=60.0), list(model.named_parameters()), [], opt)
    client.pull_initial()
    print("SERVERS " + " ".join(str(p.pid) for p in client.server_procs), flush=True)
    # fail once the test has seen the server alive (its line), or after 120 s without it
    select.select([sys.stdin], [], [], 120.0)
    raise RuntimeError("user code failed before close()")


if __name__ == "__main__":
    if sys.argv[1:] == ["without-close"]:
        dedicated_job_without_close()
    else:
        dedicated_job()
