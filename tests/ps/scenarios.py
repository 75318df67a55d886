"""Code that runs inside the spawned worker processes of the PS tests (one session runs many checks)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ivyplug.ps import PSClient, PSConfig
from tests.ps import introspection
from tests.ps.diffs import max_abs_diff


def mlp(seed: int, bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 16)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers)


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)
    if name == "lamb":
        from ivyplug.optim import LAMB

        return LAMB(params, lr=0.02, weight_decay=0.01)
    raise ValueError(name)


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def start(model: torch.nn.Module, opt: torch.optim.Optimizer, **cfg: Any) -> PSClient:
    client = PSClient.start(PSConfig(**cfg), list(model.named_parameters()), list(model.named_buffers()), opt)
    client.pull_initial()
    return client


def grad_sq(model: torch.nn.Module) -> float:
    """Squared L2 norm of ``model``'s gradients, in float64."""
    return sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- world 2 ------------------------------------------------------------------------------------
def sync_equivalence(rank: int, world: int) -> dict[str, Any]:
    """sync, 2 workers with 3 and 5 samples, clip 0.5, StepLR == one process on the 8 samples."""
    out: dict[str, Any] = {}
    sizes = [3, 5]
    for name in ("sgd", "adamw", "lamb"):
        model = mlp(seed=rank)  # different per rank: the PS must start everyone from rank 0's copy
        opt = make_opt(name, model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        # LAMB split explicitly (on one host "auto" keeps its tensors whole): its pieces take the whole tensor's ratio
        split = {"max_shard_bytes": 256} if name == "lamb" else {}
        client = start(model, opt, mode="sync", timeout=30.0, **split)
        ref = mlp(seed=0)
        ref_opt = make_opt(name, ref.parameters())
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        norms: list[tuple[float | None, float]] = []  # (what the client reports, the reference's |g|²)
        for step in range(5):
            x, y = batch(step, sum(sizes))
            lo = sum(sizes[:rank])
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[lo : lo + sizes[rank]]), y[lo : lo + sizes[rank]]).backward()
            client.step(sizes[rank], max_grad_norm=0.5)
            sched.step()
            ref.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            norms.append((client.combined_grad_sq_norm, grad_sq(ref)))
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_sched.step()
        client.sync()
        out[name] = max_abs_diff(_params(model), _params(ref))
        out[f"{name}_grad_sq"] = norms
        out[f"{name}_split"] = client.plan.split_tensors()  # max_shard_bytes="auto" (the default)
        out[f"{name}_balance"] = client.plan.balance
        client.close()
    # "auto" on one host keeps LAMB's tensors whole in sync mode (the plan alone)
    model = mlp(seed=0)
    client = start(model, make_opt("lamb", model.parameters()), mode="sync", timeout=30.0)
    out["lamb_auto_split"] = client.plan.split_tensors()
    client.close()
    # async, split explicitly: LAMB's pieces combine their trust ratios push by push, the sums crossing the ranks
    model = mlp(seed=rank)
    client = start(model, make_opt("lamb", model.parameters()), mode="async", timeout=30.0, max_shard_bytes=256)
    out["async_lamb_split"] = client.plan.split_tensors()
    initial = _params(model)
    for step in range(4):
        x, y = batch(50 + step * world + rank, 4)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        client.step(4)
    client.sync()
    out["async_lamb_moved"] = max_abs_diff(_params(model), initial)
    out["async_lamb_params"] = _params(model)
    client.close()
    return out


def buffers_rule(rank: int, world: int) -> dict[str, Any]:
    """BatchNorm buffers: sync = weighted mean of the pushed buffers, async = running mean; pulls replace."""
    out: dict[str, Any] = {}
    sizes = [4, 6]
    for mode in ("sync", "async"):
        model = mlp(seed=rank, bn=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        client = start(model, opt, mode=mode, timeout=30.0)
        initial = {n: b.clone() for n, b in model.named_buffers()}
        x, y = batch(7 + rank, sizes[rank])
        model.train()
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        pushed = {n: b.clone() for n, b in model.named_buffers()}
        if mode == "sync":
            client.step(sizes[rank])
        else:  # rank 0 first, then rank 1: a known order
            for turn in range(world):
                if turn == rank:
                    client.step(sizes[rank])
                dist.barrier()
        out[f"{mode}_grad_sq"] = client.combined_grad_sq_norm
        client.sync()
        out[mode] = {"initial": initial, "pushed": pushed, "after": {n: b.clone() for n, b in model.named_buffers()}}
        client.close()
    return out


def _gather_to_rank0(client: PSClient, rank: int) -> dict[int, list[int]] | None:
    """Each worker's own bytes (of its own length; rank 1's the longer) through the workers' group to rank 0."""
    gathered = client.workers.gather_to_rank0(bytes([rank + 1]) * (rank + 2), "a test's gather")
    return None if gathered is None else {r: list(b) for r, b in gathered.items()}


def resume_bitwise(rank: int, world: int) -> dict[str, Any]:
    """sync: state_dict after 3 steps, continue 3; a fresh client loaded from it continues identically."""
    sizes = [4, 4]

    def train(client: PSClient, model: torch.nn.Module, steps: range) -> None:
        for step in steps:
            x, y = batch(step, sum(sizes))
            lo = sum(sizes[:rank])
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[lo : lo + sizes[rank]]), y[lo : lo + sizes[rank]]).backward()
            client.step(sizes[rank], max_grad_norm=1.0)

    model = mlp(seed=5, bn=True)
    opt = make_opt("lamb", model.parameters())
    client = start(model, opt, mode="sync", timeout=30.0)
    train(client, model, range(3))
    client.sync()
    sd = client.state_dict()
    train(client, model, range(3, 6))
    client.sync()
    first = _params(model) + [b.clone() for b in model.buffers()]
    final_sd = client.state_dict()
    gathered = _gather_to_rank0(client, rank)
    client.close()

    model2 = mlp(seed=99, bn=True)
    opt2 = make_opt("lamb", model2.parameters())
    client2 = start(model2, opt2, mode="sync", timeout=30.0)
    client2.load_state_dict(sd)
    train(client2, model2, range(3, 6))
    client2.sync()
    second = _params(model2) + [b.clone() for b in model2.buffers()]
    sd2 = client2.state_dict()
    client2.close()
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(first, second, strict=True)),
        "versions": [s["version"] for s in final_sd["shards"]],
        "versions_resumed": [s["version"] for s in sd2["shards"]],
        "gathered": gathered,
    }


def step_clocks(rank: int, world: int, mode: str, staleness: int | None, slow_rank: int, steps: int) -> dict[str, Any]:
    """The workers' own record of an ssp (or, as a control, async) run; the slowed rank sleeps each step.

    On the system-wide monotonic clock each worker notes when it starts step c (``starts[c]``), when it
    calls ``step`` to push step c (``sends[c]``) and when that step's pull returned (``returns[c]``).
    Nothing is read from the server: tests/ps/test_distributed.py checks the SSP bound from these alone.
    """
    model = mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    client = start(model, opt, mode=mode, staleness=staleness, timeout=30.0)
    dist.barrier()  # every worker starts step 0 together: the fast ones' lead is what the mode allows
    starts, sends, returns = [], [], []
    for step in range(steps):
        starts.append(time.monotonic())
        x, y = batch(step, 4)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == slow_rank:
            time.sleep(0.03)
        sends.append(time.monotonic())
        client.step(4)
        returns.append(time.monotonic())
    client.sync()
    metrics = client.metrics()
    client.close()
    return {"starts": starts, "sends": sends, "returns": returns, "metrics": metrics}


def dispatch(rank: int, world: int, slow_rank: int) -> dict[str, Any]:
    """async + batch queue: every index once per epoch; the slowed rank gets fewer; a stopped epoch hands out no
    more; the stop flag travels."""
    model = mlp(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    client = start(model, opt, mode="async", timeout=30.0)
    epochs: list[list[int]] = []
    ahead = 0  # requests rank 1 (asking over the wire) sent ahead of its next batch
    for epoch in range(2):
        client.start_epoch(epoch, 30)
        if rank == 1:
            introspection.ask_ahead_now(client)
        got = []
        while (index := client.next_batch()) is not None:
            ahead += introspection.asked_ahead(client)
            got.append(index)
            x, y = batch(index, 4)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rank == slow_rank:
                time.sleep(0.04)
            client.step(4)
        epochs.append(got)
        client.sync()
    # a third epoch that rank 1 (asking over the wire) stops after one batch each: nothing more is handed out
    client.start_epoch(2, 30)
    if rank == 1:
        introspection.ask_ahead_now(client)  # it holds an index asked ahead when it stops
    got = [client.next_batch()]
    ahead += introspection.asked_ahead(client)
    x, y = batch(got[0], 4)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    client.step(4)
    if rank == 1:
        client.stop_epoch()
    client.workers.barrier("rank 1 to stop the epoch")
    after_stop = [client.next_batch(1), client.next_batch(1)]
    epochs.append(got)
    client.end_epoch()
    client.sync()
    if rank == 1:
        client.request_stop()
    client.sync()  # replies after the STOP carry the flag
    stopped = client.stop_requested()
    metrics = client.metrics()
    client.close()
    return {"epochs": epochs, "after_stop": after_stop, "stopped": stopped, "metrics": metrics, "ahead": ahead}


def dedicated_servers(rank: int, world: int) -> dict[str, Any]:
    """num_servers=2 (separate CPU processes started by rank 0): sync equivalence and nothing lost."""
    out: dict[str, Any] = {}
    sizes = [3, 5]
    for name in ("lamb",):  # one optimizer: starting server processes is the slow part here
        model = mlp(seed=rank + 10)
        opt = make_opt(name, model.parameters())
        client = start(model, opt, mode="sync", num_servers=2, timeout=60.0)
        ref = mlp(seed=10)
        ref_opt = make_opt(name, ref.parameters())
        norms: list[tuple[float | None, float]] = []
        for step in range(3):
            x, y = batch(step, sum(sizes))
            lo = sum(sizes[:rank])
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[lo : lo + sizes[rank]]), y[lo : lo + sizes[rank]]).backward()
            client.step(sizes[rank], max_grad_norm=0.5)
            ref.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            norms.append((client.combined_grad_sq_norm, grad_sq(ref)))
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
        client.sync()
        out[name] = max_abs_diff(_params(model), _params(ref))
        out[f"{name}_grad_sq"] = norms
        out[f"{name}_versions"] = [s["version"] for s in client.state_dict()["shards"]]
        out["procs_before_close"] = len(client.server_procs)
        out["gathered"] = _gather_to_rank0(client, rank)
        client.close()
        out["procs_alive_after_close"] = sum(p.is_alive() for p in client.server_procs)
    return out


def session_world2(rank: int, world: int) -> dict[str, Any]:
    return {
        "sync_equivalence": sync_equivalence(rank, world),
        "buffers": buffers_rule(rank, world),
        "resume": resume_bitwise(rank, world),
        "ssp": step_clocks(rank, world, "ssp", staleness=1, slow_rank=1, steps=12),
        "ssp_async": step_clocks(rank, world, "async", staleness=None, slow_rank=1, steps=12),
        "dispatch": dispatch(rank, world, slow_rank=0),
        "lost": nothing_lost(rank, world, rounds=3, pushes=12),
        "dedicated": dedicated_servers(rank, world),
    }


# -- world 3 ------------------------------------------------------------------------------------
def nothing_lost(rank: int, world: int, rounds: int, pushes: int) -> dict[str, Any]:
    """async, SGD lr=1, integer gradients, no staleness scaling, random sleeps between pushes."""
    model = mlp(seed=3)
    with torch.no_grad():  # integer-valued start so that every sum is exact in fp32
        for p in model.parameters():
            p.copy_(torch.randint(-50, 50, p.shape).float())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # the servers start from rank 0's values (identical on every rank here); not what pull_initial returns:
    # in async mode another worker's first pushes may already have landed by then
    initial = _params(model)
    client = start(model, opt, mode="async", staleness_scaling="none", timeout=30.0, max_shard_bytes=256)
    sent = [torch.zeros_like(p) for p in initial]
    rng = random.Random(rank * 7919 + 1)
    gen = torch.Generator().manual_seed(rank + 10)
    for _ in range(rounds):
        for _ in range(pushes):
            for p, acc in zip(model.parameters(), sent, strict=True):
                p.grad = torch.randint(-3, 4, p.shape, generator=gen).float()
                acc += p.grad
            time.sleep(rng.choice([0.0, 0.0, 0.001, 0.003]))
            client.step(1)
        client.sync()
    sd = client.state_dict()
    final = _params(model)
    client.close()
    return {
        "initial": initial,
        "sent": sent,
        "final": final,
        "versions": [s["version"] for s in sd["shards"]],
        "split": client.plan.split_tensors(),
        "shards": client.plan.num_shards,
    }


def session_world3(rank: int, world: int, outdir: str) -> dict[str, Any]:
    """3 workers: nothing lost, SSP bound + async control (results saved per rank), then the last rank goes silent."""
    results = {
        "lost": nothing_lost(rank, world, rounds=2, pushes=10),
        "ssp": step_clocks(rank, world, "ssp", staleness=2, slow_rank=2, steps=10),
        "ssp_async": step_clocks(rank, world, "async", staleness=None, slow_rank=2, steps=10),
    }
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    return silent_peer(rank, world)


# -- failure ------------------------------------------------------------------------------------
def _wait_stopped(pid: int, within: float = 20.0) -> None:
    """Wait until process ``pid`` is stopped (state T in /proc), at most ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {within:g} s")


def silent_peer(rank: int, world: int) -> dict[str, Any]:
    """A peer that never answers: sync (the last rank never pushes) then async (it is frozen by SIGSTOP).

    The other ranks' step must raise PSTimeoutError naming what it waited for, after about ``timeout`` s.
    """
    from ivyplug.ps import PSTimeoutError

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        model = mlp(seed=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        client = start(model, opt, mode=mode, timeout=2.0)
        pids: list[Any] = [None] * world
        dist.all_gather_object(pids, os.getpid())
        dist.barrier()
        if rank != world - 1 and mode == "async":
            _wait_stopped(pids[world - 1])  # a push that reached it before its SIGSTOP would be answered
        if rank == world - 1:
            if mode == "async":
                os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills us
                time.sleep(60)
            dist.barrier()  # sync: alive (its server thread answers) but never pushes
            client.close()
            continue
        x, y = batch(0, 4)
        torch.nn.functional.mse_loss(model(x), y).backward()
        t0 = time.monotonic()
        try:
            client.step(4)
            out[mode] = {"error": None, "seconds": time.monotonic() - t0}
        except PSTimeoutError as exc:
            out[mode] = {"error": str(exc), "seconds": time.monotonic() - t0}
        if mode == "sync":
            dist.barrier()
            client.close()
    return out
