"""A worker process that joins an ``ivyplug serve`` on its own (no launcher, no default group).

``python tests/ps/service_worker.py ADDRESS OUT.json [--steps N] [--token T] [--mode M] [--seed S] [--die-at K]``
trains a small model on a fixed regression task through the PS and writes what it saw to OUT.json. With
``--die-at K`` it SIGKILLs itself after K steps (a worker that dies mid-run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

from ivyplug.ps import PSClient, PSConfig


def model_and_optimizer(seed: int, hidden: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def task(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, torch.tanh(x @ w)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--token", default=None)
    ap.add_argument("--mode", default="async")
    ap.add_argument("--staleness", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt = model_and_optimizer(args.seed, args.hidden)
    out: dict[str, object] = {"pid": os.getpid(), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    x, y = task()
    started = time.monotonic()
    try:
        cfg = PSConfig(
            mode=args.mode, staleness=args.staleness, servers=args.address, token=args.token, timeout=args.timeout
        )
        client = PSClient.start(cfg, list(model.named_parameters()), [], opt)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(out["error"], file=sys.stderr)  # as a failure after the start would print it
        out["start_s"] = time.monotonic() - started  # how long PSClient.start waited before it failed
        with open(args.out, "w") as f:
            json.dump(out, f)
        return 3
    client.pull_initial()
    out["slot"] = client.topo.link.slot if client.topo.link else -1
    out["created"] = bool(client.topo.link and client.topo.link.created)
    out["num_shards"] = client.plan.num_shards
    with torch.no_grad():
        out["start_loss"] = float(torch.nn.functional.mse_loss(model(x), y))
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        if step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.randint(0, x.shape[0], (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        client.step(32)
        if args.sleep:
            time.sleep(args.sleep)
    client.sync()
    with torch.no_grad():
        out["end_loss"] = float(torch.nn.functional.mse_loss(model(x), y))
    out["metrics"] = client.metrics()
    out["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    client.close()
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
