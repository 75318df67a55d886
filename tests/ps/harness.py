"""Run a function in N real processes with a real gloo default group on 127.0.0.1; always clean up."""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tests.ports import free_port


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors through a Queue would need the (already gone) child
        q.put((rank, "ok", buf.getvalue()))
        q.close()
        q.join_thread()
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
        q.close()
        q.join_thread()  # flush the queue's feeder thread before the hard exit
        # the peers may hang on a collective with us: end now, the parent kills the rest
        os._exit(3)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0, need: list[int] | None = None
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return results by rank.

    Raises with the child's traceback if any rank failed; kills every child still alive at the end.
    ``need``: only wait for these ranks' results (the others get None and are killed).
    """
    need = list(range(world)) if need is None else need
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q), daemon=False) for r in range(world)]
    results: dict[int, tuple[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        import queue as _queue
        import time

        deadline = time.monotonic() + timeout
        while any(r not in results for r in need):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = q.get(timeout=min(left, 0.5))
                results[rank] = (status, value)
                if status == "err":
                    break
            except _queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                    # a child died without reporting (e.g. SIGABRT)
                    time.sleep(0.5)
                    if q.empty():
                        break
        if len(need) == world:
            for p in procs:
                p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        q.close()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(results.items()) if s == "err"]
    if errors:
        raise AssertionError("worker failed:\n" + "\n".join(errors))
    missing = [r for r in need if r not in results]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"rank(s) {missing} gave no result within {timeout} s (exit codes {codes})")
    import torch

    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) if r in results else None for r in range(world)]
