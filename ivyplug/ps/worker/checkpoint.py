"""The PS state of a job in and out of checkpoints: what it records, and what may resume from it.

A state holds every shard's params, buffers, optimizer state, version and clocks, plus the mode and
topology of the job that wrote it. It resumes in another mode or with another number of workers (params,
buffers and optimizer state carry over; clocks count each worker's pushes, so every worker restarts at the
saved version); another shard plan (number of shards, model) is refused with an error naming both jobs
(:func:`mismatch`: a caller that holds the optimizer's state per parameter, as the Lightning strategy's
checkpoints do, loads that instead).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from ivyplug.ps.server.shard import piece_shape
from ivyplug.ps.sharding import Piece, ShardPlan

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


def check_format(state: Any) -> None:
    """ValueError unless ``state`` is a PS state dict this ivyplug writes."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a PS state dict of this ivyplug (format {found!r}, expected {STATE_FORMAT!r})")


def mismatch(state: Any, meta: dict[str, Any]) -> str | None:
    """Why ``state`` (ValueError: not a PS state, :func:`check_format`) cannot be loaded into the job described
    by ``meta``: another shard plan (None: it can; another number of workers or mode restarts the clocks)."""
    check_format(state)
    saved, here = describe(state), describe(meta)
    if state["num_shards"] != meta["num_shards"] or state["plan_signature"] != meta["plan_signature"]:
        return (
            f"the PS state was saved by a job with {saved}, this job has {here}; the shard plan differs: another "
            "model, number of shards or max_shard_bytes"
        )
    return None


def shards_to_load(state: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-shard states to load into the job described by ``meta`` (ValueError if it cannot resume).

    In another mode, or with another number of workers, the clocks restart (every worker at the saved version):
    they count each worker's pushes, which mean something else there."""
    why = mismatch(state, meta)
    if why is not None:
        raise ValueError(f"cannot resume: {why} (resume with the same ones)")
    restart = state["mode"] != meta["mode"] or state.get("num_workers", meta["num_workers"]) != meta["num_workers"]
    return [dict(sh, reset_clocks=True) if restart else sh for sh in state["shards"]]


class NotPerElement(ValueError):
    """An optimizer state value of a tensor cut over the shards that is not per element (cannot be joined)."""


def _optimizer_pieces(plan: ShardPlan, param_group: Sequence[int], shard: int) -> list[Piece]:
    """The shard's param pieces in the order of its optimizer's state indices: group by group (sorted), each group's
    pieces in plan order, pieces outside the optimizer left out (``OptimizerSpec.build``)."""
    pieces = [p for p in plan.pieces[shard] if p.kind == "param"]
    groups = sorted({param_group[p.index] for p in pieces if param_group[p.index] >= 0})
    return [p for g in groups for p in pieces if param_group[p.index] == g]


def _row_block(value: Any, piece: Piece, shape: tuple[int, ...], name: str, key: str) -> Any:
    """``piece``'s rows of a per-element state value of a tensor of ``shape``; any other value as it is where the
    piece is the whole tensor, else refused (:class:`NotPerElement`)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and tuple(value.shape) == shape:
        return value[piece.row_start : piece.row_end].clone()
    if value.dim() > 0 and piece_shape(shape, piece) != shape:
        raise NotPerElement(
            f"the optimizer's {key!r} of parameter {name!r} is not per element (shape {tuple(value.shape)} for a "
            f"tensor of {shape}): it cannot be cut into the row blocks the PS holds that tensor in"
        )
    return value.clone()


def take_param_states(
    state: dict[str, Any], plan: ShardPlan, param_group: Sequence[int]
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """``state`` without the shards' optimizer state (each shard keeps its param groups), and that state joined per
    parameter: param index -> its state as an optimizer over the whole tensor holds it (a split tensor's row blocks
    concatenated; a value that is not per element, such as ``step``, its first block's). ``param_group``: each
    param index's group in the optimizer, -1 for none (``OptimizerSpec.param_group``)."""
    blocks: dict[int, list[tuple[Piece, dict[str, Any]]]] = {}
    shards = []
    for shard, sh in enumerate(state["shards"]):
        opt = sh.get("optimizer")
        if opt is not None:
            for k, piece in enumerate(_optimizer_pieces(plan, param_group, shard)):
                st = opt["state"].get(k)
                if st:
                    blocks.setdefault(piece.index, []).append((piece, st))
            sh = {**sh, "optimizer": {**opt, "state": {}}}
        shards.append(sh)
    num_pieces = collections.Counter(p.index for ps in plan.pieces for p in ps if p.kind == "param")
    joined: dict[int, dict[str, Any]] = {}
    for index, parts in blocks.items():
        parts.sort(key=lambda part: part[0].row_start)
        first = parts[0][1]
        name = plan.specs[index].name
        if len(parts) != num_pieces[index] or any(set(st) != set(first) for _, st in parts):
            raise ValueError(f"the PS state of parameter {name!r} is not in every one of its pieces")
        if len(parts) == 1:  # whole: its state is the whole tensor's, whatever it holds
            joined[index] = first
            continue
        for piece, st in parts:
            rows = piece_shape(plan.specs[index].shape, piece)
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != rows:
                    raise NotPerElement(
                        f"the optimizer's {key!r} of parameter {name!r}, cut in row blocks over the shards, is not "
                        f"per element (shape {tuple(value.shape)} in a block of {rows}): it cannot be joined into "
                        "the whole tensor's"
                    )
        joined[index] = {
            key: torch.cat([st[key] for _, st in parts])
            if isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for key, value in first.items()
        }
    return {**state, "shards": shards}, joined


def put_param_states(
    state: dict[str, Any], states: dict[int, dict[str, Any]], plan: ShardPlan, param_group: Sequence[int]
) -> dict[str, Any]:
    """The reverse of :func:`take_param_states`: ``state`` with each shard's optimizer state cut from ``states``
    (param index -> its state over the whole tensor; a parameter it lacks starts without state)."""
    shards = []
    for shard, sh in enumerate(state["shards"]):
        opt = sh.get("optimizer")
        if opt is not None:
            pieces = _optimizer_pieces(plan, param_group, shard)
            own = {
                k: {
                    key: _row_block(v, piece, plan.specs[piece.index].shape, plan.specs[piece.index].name, key)
                    for key, v in states[piece.index].items()
                }
                for k, piece in enumerate(pieces)
                if states.get(piece.index)
            }
            sh = {**sh, "optimizer": {**opt, "state": own}}
        shards.append(sh)
    return {**state, "shards": shards}
