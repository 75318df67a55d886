"""LAMB tensors split across shards: each piece steps with the trust ratio of its whole tensor.

LAMB scales a tensor's update by ``‖x‖/‖u‖`` over the whole tensor, so a tensor cut into row blocks on several
shards cannot be stepped piece by piece without changing the update. Each shard runs a split tensor's step in two
halves around an exchange: it computes its pieces' moments and direction and the sums of squares of ``x`` and
``u`` (``ivyplug.optim.functional``'s :func:`~ivyplug.optim.functional.lamb_direction`), sends them to the shards
holding the other pieces, and applies its pieces once every piece's sums of that update are in: the ratio is the
one an unsplit step takes. This is what lets ``max_shard_bytes="auto"`` split LAMB's large layers, so that no one
server holds most bytes (and carries most traffic).

An update is named by a key both ends compute alike: ``(-1, version)`` for a sync step (every shard steps the same
combined gradient in the same step), ``(worker, push number)`` for an async/ssp push (every shard applies each
push on arrival, in its own order among the workers: a half step never waits, so no order can deadlock). In
async/ssp a push's moments and direction are taken at its arrival; its parameters move when the other pieces'
sums are in, so pushes of other workers that arrive in between see its moments and not yet its step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ivyplug.optim.functional import Direction, direction_ratio, lamb_apply, lamb_direction
from ivyplug.optim.lamb_hyper import LambHyper
from ivyplug.optim.optimizer import LAMB
from ivyplug.ps.sharding import Piece, ShardPlan

#: an update of split tensors: (-1, sync version) or (worker, push number)
Key = tuple[int, int]


def combines_trust(optimizer_cls: type) -> bool:
    """Whether shards step ``optimizer_cls``'s split tensors with their whole tensor's trust ratio."""
    return optimizer_cls is LAMB


def holders(plan: ShardPlan) -> dict[int, set[int]]:
    """Tensor index -> the shards holding a piece of it, for every parameter cut into more than one piece (the
    pieces of one shard are separate tensors of its optimizer too, so they combine their sums as well)."""
    shards: dict[int, set[int]] = {}
    count: dict[int, int] = {}
    for s, pieces in enumerate(plan.pieces):
        for p in pieces:
            if p.kind == "param":
                shards.setdefault(p.index, set()).add(s)
                count[p.index] = count.get(p.index, 0) + 1
    return {t: held for t, held in shards.items() if count[t] > 1}


class _Half(NamedTuple):
    """A piece's first half: its direction (in the update's scratch tensor of that piece), and the hyperparameters
    its second half takes."""

    direction: Direction
    hyper: LambHyper


class SplitTrust:
    """One shard's pieces of split LAMB tensors, and the sums of squares of the updates in progress.

    Owned by its :class:`~ivyplug.ps.server.shard.Shard`, and called only under that shard's lock.
    """

    def __init__(
        self,
        shard: int,
        plan: ShardPlan,
        optimizer: LAMB,
        masters: Sequence[torch.Tensor],
        pieces: Sequence[Piece],
        groups: Sequence[int],
    ) -> None:
        self.shard = shard
        self.optimizer = optimizer
        split = holders(plan)
        #: positions (in the shard's masters) of the pieces stepped here in two halves
        self.positions = [i for i, p in enumerate(pieces) if p.index in split and groups[i] >= 0]
        self.tensors = sorted({pieces[i].index for i in self.positions})
        self.holders = {t: split[t] - {shard} for t in self.tensors}
        #: the shards that hold another piece of one of these tensors
        self.peers = sorted(set().union(*self.holders.values())) if self.tensors else []
        self._masters = masters
        self._pieces = pieces
        # by position: a loaded state_dict replaces the group dicts (the shard re-points its map at them), not
        # their order
        self._group_index = {id(p): k for k, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._spare: list[dict[int, torch.Tensor]] = []  # scratch sets of finished updates, for the next ones
        # update -> (its scratch set, position -> its first half), in the order they began
        self._begun: dict[Key, tuple[dict[int, torch.Tensor], dict[int, _Half]]] = {}
        self._sums: dict[Key, dict[int, dict[int, tuple[float, float]]]] = {}  # update -> shard -> tensor -> sums
        self._waiting: dict[int, int] = {}  # worker -> its async/ssp updates in progress (for waits())

    def begin(
        self, key: Key, grads: torch.Tensor, has_grad: Sequence[bool], lr_scale: float = 1.0
    ) -> list[float] | None:
        """First half of update ``key`` for the pieces whose tensor has a gradient (``has_grad``, by tensor): moments
        and direction from ``grads`` (the shard's flat gradient, already clipped), the learning rate of the second
        half times ``lr_scale``. Returns this shard's sums to send to :attr:`peers` (tensor, ‖x‖², ‖scratch‖², …),
        or None when no split tensor steps."""
        stepped = [i for i in self.positions if has_grad[self._pieces[i].index]]
        if not stepped:
            return None
        scratch = self._spare.pop() if self._spare else {i: torch.empty_like(self._masters[i]) for i in self.positions}
        halves: dict[int, _Half] = {}
        mine: dict[int, tuple[float, float]] = {}
        for i in stepped:
            m, p = self._masters[i], self._pieces[i]
            exp_avg, exp_avg_sq, counter = self.optimizer.moments(m)
            h = LAMB.hyper(self.optimizer.param_groups[self._group_index[id(m)]])
            grad = grads[p.offset : p.offset + p.numel].view(m.shape)
            with torch.no_grad():
                d = lamb_direction(m.detach(), grad, exp_avg, exp_avg_sq, counter, h, scratch[i])
            halves[i] = _Half(d, dataclasses.replace(h, lr=h.lr * lr_scale))
            psq, dsq = mine.get(p.index, (0.0, 0.0))
            mine[p.index] = (psq + d.param_sq, dsq + d.scratch_sq)
        self._begun[key] = (scratch, halves)
        self._waiting[key[0]] = self._waiting.get(key[0], 0) + 1
        self.note(key, self.shard, mine)
        return [x for t, (psq, dsq) in sorted(mine.items()) for x in (float(t), psq, dsq)]

    def note(self, key: Key, shard: int, sums: dict[int, tuple[float, float]]) -> None:
        """``shard``'s sums of squares of update ``key``, by tensor."""
        self._sums.setdefault(key, {})[shard] = sums

    def note_values(self, key: Key, shard: int, values: Sequence[float]) -> None:
        """:meth:`note` from the flat list :meth:`begin` returns (what travels between shards)."""
        if len(values) % 3:
            raise ValueError(f"trust-ratio sums from shard {shard} hold {len(values)} values, not triples")
        self.note(key, shard, {int(values[k]): (values[k + 1], values[k + 2]) for k in range(0, len(values), 3)})

    def missing(self, key: Key) -> list[int]:
        """The shards whose sums update ``key`` still waits for (empty: it can finish)."""
        got = self._sums.get(key, {})
        tensors = {self._pieces[i].index for i in self._begun[key][1]} if key in self._begun else set()
        return sorted({s for t in tensors for s in self.holders[t] if t not in got.get(s, {})})

    def begun(self, key: Key) -> bool:
        return key in self._begun

    def waits(self, worker: int) -> bool:
        """Whether a push of ``worker`` (async/ssp) waits for its second half."""
        return self._waiting.get(worker, 0) > 0

    def ready(self) -> list[Key]:
        """The updates whose every piece's sums are in, in the order they began."""
        return [key for key in self._begun if not self.missing(key)]

    def finish(self, key: Key) -> None:
        """Second half of update ``key``: every begun piece takes its whole tensor's ratio (once :meth:`missing` is
        empty; the caller made the masters writable)."""
        scratch, halves = self._drop(key)
        sums = self._sums.pop(key)
        for i, half in halves.items():
            t = self._pieces[i].index
            # in shard order, so that every shard adds the same numbers in the same order (the same ratio, bit for bit)
            parts = [sums[s][t] for s in sorted(sums) if t in sums[s]]
            psq, dsq = sum(x for x, _ in parts), sum(x for _, x in parts)
            ratio = direction_ratio(psq, dsq, half.direction.scale, half.hyper)
            with torch.no_grad():
                lamb_apply(self._masters[i].detach(), scratch[i], half.direction.scale, ratio, half.hyper.lr)
        self._spare.append(scratch)

    def _drop(self, key: Key) -> tuple[dict[int, torch.Tensor], dict[int, _Half]]:
        """Update ``key`` out of the updates in progress: its scratch set and first halves."""
        scratch, halves = self._begun.pop(key)
        left = self._waiting.pop(key[0]) - 1
        if left:
            self._waiting[key[0]] = left
        return scratch, halves

    def forget(self, worker: int | None = None) -> None:
        """Drop the updates in progress (an aborted sync step), or those of ``worker`` (it rejoined; a push of its
        last life that reached only some shards cannot finish): their moments moved, their parameters will not;
        sums already in for them go too."""
        for key in [k for k in self._begun if worker is None or k[0] == worker]:
            self._spare.append(self._drop(key)[0])
        for key in [k for k in self._sums if (worker is None and k[0] < 0) or k[0] == worker]:
            del self._sums[key]
