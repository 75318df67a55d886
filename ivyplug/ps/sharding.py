"""Deterministic assignment of parameter tensors (and buffers) to PS shards.

Whole tensors go to one shard, so a layer's LAMB trust ratio is computed where the whole layer lives.
The plan is greedy by bytes (largest first onto the least-loaded shard, ties broken by index), followed
by a bounded local search (moves and swaps off the fullest shard) that only accepts strict improvements.
Every process computes the same plan from the same shapes; nothing random, nothing order-of-arrival.

A parameter larger than ``max_shard_bytes`` is split along dim 0 into row blocks that are placed like
separate tensors. Consequence for LAMB: the trust ratio is then computed per row block, not per layer.

Whole tensors cannot balance a model whose largest tensor is bigger than the ideal shard (total / number
of shards): a 64-1024-1024-10 MLP puts 93% of its bytes on one of two servers, and that server's optimizer
step becomes every sync step's critical path. ``max_shard_bytes="auto"`` (the default) therefore splits
when splitting cannot change the update: for optimizers whose update is element-wise within a param group
(SGD, Adam, AdamW, ... — see ``ivyplug.ps.server.mirror.is_elementwise``), tensors larger than ideal/8 are cut
into row blocks of at most ideal/8, which bounds the largest shard by 1.125 x ideal (greedy placement:
the fullest shard was the emptiest when it got its last piece). For other optimizers (layer-wise statistics)
"auto" keeps whole tensors, but for ivyplug's LAMB, whose split tensors keep their trust ratio
(server/split_trust.py), in sync mode across hosts (``PSClient._splits_lamb``).
"""

from __future__ import annotations

import hashlib
import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Bytes per element of what the servers hold (fp32 master copies).
MASTER_ITEMSIZE = 4

#: ``max_shard_bytes="auto"`` cuts pieces of at most ideal / this (largest shard <= (1 + 1/8) x ideal).
AUTO_PIECES_PER_SHARD = 8


@dataclass(frozen=True)
class TensorSpec:
    """Name and shape of one parameter or buffer; ``kind`` is ``"param"`` or ``"buffer"``."""

    name: str
    shape: tuple[int, ...]
    kind: str = "param"
    is_float: bool = True  # integer buffers (BatchNorm's num_batches_tracked) follow the max rule

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def words(self) -> int:
        """fp32 words it takes on the wire and on the servers: an integer buffer travels as int64 bits
        (two words per element), so counters stay exact past 2**24."""
        return self.numel if self.is_float else 2 * self.numel


@dataclass(frozen=True)
class Piece:
    """A row block ``[row_start, row_end)`` of tensor ``index`` (whole tensor: all rows), on ``shard``.

    ``offset`` is where its elements start in the shard's flat fp32 vector. For 0-d tensors
    ``row_start == 0`` and ``row_end == 1``.
    """

    index: int
    kind: str
    row_start: int
    row_end: int
    numel: int  # fp32 words (two per element of an integer buffer, see TensorSpec.words)
    shard: int
    offset: int
    is_float: bool = True

    @property
    def nbytes(self) -> int:
        return self.numel * MASTER_ITEMSIZE


def tensor_specs(params: Sequence[tuple[str, Any]], buffers: Sequence[tuple[str, Any]] = ()) -> list[TensorSpec]:
    """The specs of named parameters and buffers (torch tensors; integer buffers follow the max rule)."""
    specs = [TensorSpec(n, tuple(p.shape), "param", True) for n, p in params]
    return specs + [TensorSpec(n, tuple(b.shape), "buffer", b.is_floating_point()) for n, b in buffers]


@dataclass
class ShardPlan:
    """The assignment: ``pieces[s]`` lists shard s's pieces in flat-vector order (params, then buffers)."""

    specs: tuple[TensorSpec, ...]
    num_shards: int
    max_shard_bytes: int | str | None
    pieces: list[list[Piece]] = field(default_factory=list)

    def shard_numel(self, shard: int) -> int:
        return sum(p.numel for p in self.pieces[shard])

    def shard_param_numel(self, shard: int) -> int:
        return sum(p.numel for p in self.pieces[shard] if p.kind == "param")

    def shard_bytes(self) -> list[int]:
        return [sum(p.nbytes for p in ps) for ps in self.pieces]

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes())

    @property
    def ideal_bytes(self) -> float:
        """Perfectly even split of all bytes."""
        return self.total_bytes / self.num_shards

    @property
    def balance(self) -> float:
        """Largest shard / ideal (1.0 is perfect; 1.0 for an empty model)."""
        if self.total_bytes == 0:
            return 1.0
        return max(self.shard_bytes()) / self.ideal_bytes

    @property
    def lower_bound_bytes(self) -> float:
        """No whole-piece plan can have a largest shard below this: max(ideal, largest piece)."""
        largest = max((p.nbytes for ps in self.pieces for p in ps), default=0)
        return max(self.ideal_bytes, float(largest))

    def float_ranges(self, shard: int) -> list[tuple[int, int]]:
        """Word ranges ``[a, b)`` of ``shard``'s flat vector that hold floats (params, float buffers),
        merged where adjacent: what a finiteness check looks at (integer bits are no floats)."""
        out: list[tuple[int, int]] = []
        for p in self.pieces[shard]:
            if not p.is_float:
                continue
            if out and out[-1][1] == p.offset:
                out[-1] = (out[-1][0], p.offset + p.numel)
            else:
                out.append((p.offset, p.offset + p.numel))
        return out

    @property
    def num_params(self) -> int:
        """Parameter tensors in the plan (the length of a push's has-gradient mask)."""
        return sum(1 for s in self.specs if s.kind == "param")

    def nonempty_shards(self) -> list[int]:
        return [s for s, ps in enumerate(self.pieces) if ps]

    def split_tensors(self) -> list[str]:
        """Names of tensors that were split row-wise."""
        seen: dict[int, int] = {}
        for ps in self.pieces:
            for p in ps:
                seen[p.index] = seen.get(p.index, 0) + 1
        return [self.specs[i].name for i, n in sorted(seen.items()) if n > 1]

    def report(self) -> dict[str, object]:
        """Balance report: bytes per shard, ideal, largest/ideal, lower bound, split tensors."""
        return {
            "num_shards": self.num_shards,
            "shard_bytes": self.shard_bytes(),
            "ideal_bytes": self.ideal_bytes,
            "balance": self.balance,
            "lower_bound_bytes": self.lower_bound_bytes,
            "split_tensors": self.split_tensors(),
        }

    def signature(self) -> int:
        """63-bit hash of the specs and the plan (ranks compare it to detect different models)."""
        h = hashlib.sha256()
        h.update(repr((self.num_shards, self.max_shard_bytes)).encode())
        for s in self.specs:
            h.update(repr((s.name, s.shape, s.kind, s.is_float)).encode())
        return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def auto_max_shard_bytes(specs: Sequence[TensorSpec], num_shards: int, splits: bool) -> int | None:
    """What ``max_shard_bytes="auto"`` means for these tensors: ``None`` (whole tensors) or a byte limit.

    Whole tensors unless a tensor split across shards keeps the optimizer's update (``splits``: an element-wise
    update, or LAMB's in sync mode, whose shards combine the pieces' trust-ratio sums), there are several shards
    and some parameter is larger than ideal / ``AUTO_PIECES_PER_SHARD``; then that is the limit.
    """
    if not splits or num_shards < 2:
        return None
    total = sum(s.words for s in specs) * MASTER_ITEMSIZE
    limit = -(-total // (num_shards * AUTO_PIECES_PER_SHARD))  # ceil
    largest = max((s.numel * MASTER_ITEMSIZE for s in specs if s.kind == "param"), default=0)
    if limit <= 0 or largest <= limit:
        return None
    return limit


def _items(specs: Sequence[TensorSpec], max_shard_bytes: int | None) -> list[tuple[int, str, int, int, int]]:
    """Unplaced pieces as (index, kind, row_start, row_end, numel)."""
    items: list[tuple[int, str, int, int, int]] = []
    for i, spec in enumerate(specs):
        numel = spec.words
        rows = spec.shape[0] if spec.shape else 1
        nbytes = numel * MASTER_ITEMSIZE
        if (
            spec.kind == "param"
            and max_shard_bytes is not None
            and nbytes > max_shard_bytes
            and len(spec.shape) >= 1
            and rows > 1
        ):
            row_numel = numel // rows
            rows_per_piece = max(1, max_shard_bytes // (row_numel * MASTER_ITEMSIZE))
            for start in range(0, rows, rows_per_piece):
                end = min(rows, start + rows_per_piece)
                items.append((i, spec.kind, start, end, (end - start) * row_numel))
        else:
            items.append((i, spec.kind, 0, rows, numel))
    return items


def _refine(sizes: list[int], assign: list[int], num_shards: int) -> None:
    """Strictly improving moves/swaps off the fullest shard (deterministic, bounded).

    Each step makes the move (x of the fullest shard a to shard b) or swap (x for a smaller y of b) that
    minimises the larger new load of a and b; ties go to the smallest (b, x, move before swap, y). Moving
    d bytes gives ``max(load_a - d, load_b + d)``, best for d nearest half the gap, so per (b, x) only two
    sizes of b can win and bisection in b's (size, index)-sorted pieces finds them: O(m n log n) a step
    instead of O(n^2), with exactly the choices of the full rescan, because plans must not change between
    versions (a checkpoint's per-shard states only fit the plan that wrote them).
    """
    n = len(sizes)
    loads = [0] * num_shards
    by_shard: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    for k, s in enumerate(assign):
        loads[s] += sizes[k]
        by_shard[s].append((sizes[k], k))
    for lst in by_shard:
        lst.sort()
    for _ in range(4 * n + 8):
        a = max(range(num_shards), key=lambda s: (loads[s], -s))
        load_a = loads[a]
        # one representative per size on a: the smallest index (first in (size, index) order)
        firsts: list[tuple[int, int]] = []
        for sx, x in by_shard[a]:
            if not firsts or firsts[-1][0] != sx:
                firsts.append((sx, x))
        best: tuple[int, int, int, int, int] | None = None  # (new pair max, b, x, 0 move / 1 swap, y)
        for b in range(num_shards):
            gap = load_a - loads[b]
            if b == a or gap < 2:  # moving d bytes helps only for 0 < d < gap
                continue
            load_b, others, half_up = loads[b], by_shard[b], (gap + 1) // 2
            for sx, x in firsts:
                if 0 < sx < gap:
                    cand = max(load_a - sx, load_b + sx)
                    if best is None or (cand, b, x, 0, 0) < best:
                        best = (cand, b, x, 0, 0)
                # sizes of b at or below sx - gap/2 (d >= gap/2) end at pos; pos starts those above it
                pos = bisect_right(others, (sx - half_up, n))
                if pos > 0:
                    sy = others[pos - 1][0]
                    d = sx - sy
                    if 0 < d < gap:
                        y = others[bisect_left(others, (sy, -1))][1]
                        key = (max(load_a - d, load_b + d), b, x, 1, y)
                        if best is None or key < best:
                            best = key
                if pos < len(others):
                    sy, y = others[pos]
                    d = sx - sy
                    if 0 < d < gap:
                        key = (max(load_a - d, load_b + d), b, x, 1, y)
                        if best is None or key < best:
                            best = key
        if best is None:
            return
        _, b, x, kind, y = best
        _relocate(by_shard, sizes, x, a, b)
        assign[x] = b
        loads[a] -= sizes[x]
        loads[b] += sizes[x]
        if kind == 1:
            _relocate(by_shard, sizes, y, b, a)
            assign[y] = a
            loads[b] -= sizes[y]
            loads[a] += sizes[y]


def _relocate(by_shard: list[list[tuple[int, int]]], sizes: list[int], k: int, src: int, dst: int) -> None:
    """Move piece ``k`` between two shards' (size, index)-sorted lists."""
    entry = (sizes[k], k)
    lst = by_shard[src]
    del lst[bisect_left(lst, entry)]
    insort(by_shard[dst], entry)


def build_plan(specs: Sequence[TensorSpec], num_shards: int, max_shard_bytes: int | str | None = None) -> ShardPlan:
    """Assign every parameter/buffer (or row block) to one of ``num_shards`` shards, deterministically.

    ``max_shard_bytes`` is a number or ``None`` here; ``"auto"`` is resolved by the caller, who knows the
    optimizer (:func:`auto_max_shard_bytes`).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if max_shard_bytes is not None and (
        isinstance(max_shard_bytes, (bool, str)) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0
    ):
        raise ValueError(
            f"max_shard_bytes must be None or an int > 0 (resolve 'auto' with auto_max_shard_bytes), "
            f"got {max_shard_bytes!r}"
        )
    for spec in specs:
        if spec.kind not in ("param", "buffer"):
            raise ValueError(f"TensorSpec.kind must be 'param' or 'buffer', got {spec.kind!r} for {spec.name!r}")
    items = _items(specs, max_shard_bytes)
    sizes = [it[4] * MASTER_ITEMSIZE for it in items]
    order = sorted(range(len(items)), key=lambda k: (-sizes[k], k))
    assign = [0] * len(items)
    heap = [(0, j) for j in range(num_shards)]  # (load, shard): least loaded first, ties by shard index
    for k in order:
        load, target = heap[0]
        assign[k] = target
        heapq.heapreplace(heap, (load + sizes[k], target))
    if len(items) <= 4096:  # the limit of the quadratic search, kept: larger plans stay greedy as before
        _refine(sizes, assign, num_shards)
    plan = ShardPlan(specs=tuple(specs), num_shards=num_shards, max_shard_bytes=max_shard_bytes)
    on_shard: list[list[int]] = [[] for _ in range(num_shards)]
    for k, shard in enumerate(assign):
        on_shard[shard].append(k)
    for shard, mine in enumerate(on_shard):
        # params first, then buffers; within a kind by tensor index and row
        mine.sort(key=lambda k: (items[k][1] != "param", items[k][0], items[k][2]))
        offset = 0
        shard_pieces: list[Piece] = []
        for k in mine:
            index, kind, r0, r1, numel = items[k]
            shard_pieces.append(Piece(index, kind, r0, r1, numel, shard, offset, specs[index].is_float))
            offset += numel
        plan.pieces.append(shard_pieces)
    return plan
