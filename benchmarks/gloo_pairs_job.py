"""One rank of ``ivyplug bench gloo_pairs`` (``python -m ivyplug.benchmarks.gloo_pairs_job``, under ``torchrun``
or with ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` set): times transfers between two ranks and prints rank 0's
medians as one JSON line."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

#: bytes of one direction's message (half the bench MLP's fp32 gradient, a balanced shard's push)
MESSAGE_BYTES = 2_250_000


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(repeats: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    second = dist.new_group(backend="gloo")
    n = MESSAGE_BYTES // 4
    out, into = torch.ones(n), torch.empty(n)
    big_out, big_into = torch.ones(2 * n), torch.empty(2 * n)

    def wait(*works: dist.Work | None) -> None:
        for work in works:
            assert work is not None
            work.wait()

    def both_ways_one_pair() -> None:
        wait(dist.isend(out, other), dist.irecv(into, other))

    def both_ways_two_pairs() -> None:  # rank 0 sends on the default group, rank 1 on the second
        mine, theirs = (None, second) if rank == 0 else (second, None)
        wait(dist.isend(out, other, group=mine), dist.irecv(into, other, group=theirs))

    def one_way(size: int) -> Callable[[], None]:
        def go() -> None:
            src, dst = (big_out, big_into) if size == 2 else (out, into)
            if rank == 1:
                dist.send(src, 0)
            else:
                dist.recv(dst, 1)

        return go

    def all_reduce() -> None:
        dist.all_reduce(big_out)

    cases = {
        "one_way": one_way(1),
        "one_way_double": one_way(2),
        "both_ways_one_pair": both_ways_one_pair,
        "both_ways_two_pairs": both_ways_two_pairs,
        "all_reduce_double": all_reduce,
    }
    medians = {name: _median_s(fn, repeats) for name, fn in cases.items()}
    if rank == 0:
        print(json.dumps(medians), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
