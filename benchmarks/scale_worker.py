"""One worker of ``ivyplug bench scale``: ``python scale_worker.py ADDRESS OUT.json SECONDS NUMEL``.

Joins the service on its own (async mode, SGD), then pushes and pulls one tensor of NUMEL values as fast as
it can for SECONDS; writes the latency of every push+pull.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ivyplug.ps import PSClient, PSConfig


def main() -> int:
    address, out, seconds, numel = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.zeros(numel))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    client = PSClient.start(
        PSConfig(mode="async", servers=address, timeout=300.0), [("w", weight)], optimizer=optimizer
    )
    client.pull_initial()
    weight.grad = torch.zeros_like(weight)
    latencies = []
    start = time.monotonic()
    wall_start = time.time()
    while time.monotonic() - start < seconds:
        t0 = time.perf_counter()
        client.step(1)
        latencies.append(time.perf_counter() - t0)
    wall_end = time.time()
    client.close()
    with open(out, "w") as f:
        json.dump({"latencies": latencies, "start": wall_start, "end": wall_end}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
