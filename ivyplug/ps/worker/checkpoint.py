"""The PS state of a job in and out of checkpoints: what it records, and what may resume from it.

A state holds every shard's params, buffers, optimizer state, version and clocks, plus the mode and
topology of the job that wrote it. It resumes in another mode (params, buffers and optimizer state carry
over; clocks mean something else per mode, so every worker restarts at the saved version); another number
of shards or workers, or another model, is refused with an error naming both jobs.
"""

from __future__ import annotations

from typing import Any

from ivyplug.ps.sharding import ShardPlan

#: 2: integer buffers held as int64 bits (format 1 held them as fp32 values)
STATE_FORMAT = "ivyplug.ps/2"


def job_meta(mode: str, num_servers: int, num_workers: int, plan: ShardPlan) -> dict[str, Any]:
    """What a state records about the job that wrote it."""
    return {
        "mode": mode,
        "num_servers": num_servers,
        "num_workers": num_workers,
        "num_shards": plan.num_shards,
        "plan_signature": plan.signature(),
    }


def make_state(meta: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": STATE_FORMAT, **meta, "shards": shards}


def describe(state: dict[str, Any]) -> str:
    """'mode 'async', 2 workers, 2 shards (one per worker)' for error messages."""
    servers = state.get("num_servers")
    where = "one per worker" if servers == 0 else (f"num_servers={servers}" if servers is not None else "?")
    workers = state.get("num_workers", "?")
    return f"mode {state.get('mode')!r}, {workers} workers, {state.get('num_shards')} shards ({where})"


def shards_to_load(state: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-shard states to load into the job described by ``meta`` (ValueError if it cannot resume)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a PS state dict of this ivyplug (format {found!r}, expected {STATE_FORMAT!r})")
    saved, here = describe(state), describe(meta)
    if state["num_shards"] != meta["num_shards"] or state["plan_signature"] != meta["plan_signature"]:
        raise ValueError(
            f"cannot resume: the PS state was saved by a job with {saved}, this job has {here}; the shard plan "
            "differs: another model, number of shards or max_shard_bytes (resume with the same ones)"
        )
    if state.get("num_workers", meta["num_workers"]) != meta["num_workers"]:
        raise ValueError(f"cannot resume: the PS state was saved by a job with {saved}, this job has {here}")
    convert = state["mode"] != meta["mode"]
    return [dict(sh, reset_clocks=True) if convert else sh for sh in state["shards"]]
