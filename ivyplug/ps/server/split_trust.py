"""LAMB tensors split across shards: each piece steps with the trust ratio of its whole tensor.

LAMB scales a tensor's update by ``‖x‖/‖u‖`` over the whole tensor, so a tensor cut into row blocks on several
shards cannot be stepped piece by piece without changing the update. In sync mode every shard steps the same
combined gradient in the same step, so the step runs in two halves around an exchange: each shard computes its
pieces' moments and direction and the sums of squares of ``x`` and ``u`` (``ivyplug.optim.functional``'s
:func:`~ivyplug.optim.functional.lamb_direction`), sends them to the shards holding the other pieces, and applies
its pieces once every piece's sums of that step are in: the ratio is the one an unsplit step takes. This is what
lets ``max_shard_bytes="auto"`` split LAMB's large layers in sync mode, so that no one server holds most bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ivyplug.optim.functional import Direction, direction_ratio, lamb_apply, lamb_direction
from ivyplug.optim.optimizer import LAMB
from ivyplug.ps.sharding import Piece, ShardPlan


def combines_trust(optimizer_cls: type, mode: str) -> bool:
    """Whether a sync shard steps ``optimizer_cls``'s split tensors with their whole tensor's trust ratio."""
    return optimizer_cls is LAMB and mode == "sync"


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


class SplitTrust:
    """One shard's pieces of split LAMB tensors, and the sums of squares of the step in progress.

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
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._scratch = {i: torch.empty_like(masters[i]) for i in self.positions}
        self._step: int | None = None
        self._begun: dict[int, Direction] = {}  # position -> its half step
        self._sums: dict[int, dict[int, dict[int, tuple[float, float]]]] = {}  # step -> shard -> tensor -> sums

    def begin(self, step: int, grads: torch.Tensor, has_grad: Sequence[bool]) -> list[float] | None:
        """First half of sync step ``step`` for the pieces whose tensor has a gradient (``has_grad``, by tensor):
        moments and direction from ``grads`` (the shard's flat combined gradient, already clipped). Returns this
        shard's sums to send to :attr:`peers` (tensor, ‖x‖², ‖scratch‖², …), or None when no split tensor steps."""
        stepped = [i for i in self.positions if has_grad[self._pieces[i].index]]
        if not stepped:
            return None
        self._step = step
        mine: dict[int, tuple[float, float]] = {}
        for i in stepped:
            m, p = self._masters[i], self._pieces[i]
            exp_avg, exp_avg_sq, counter = self.optimizer.moments(m)
            h = LAMB.hyper(self._group_of[id(m)])
            grad = grads[p.offset : p.offset + p.numel].view(m.shape)
            with torch.no_grad():
                d = lamb_direction(m.detach(), grad, exp_avg, exp_avg_sq, counter, h, self._scratch[i])
            self._begun[i] = d
            psq, dsq = mine.get(p.index, (0.0, 0.0))
            mine[p.index] = (psq + d.param_sq, dsq + d.scratch_sq)
        self.note(step, self.shard, mine)
        return [x for t, (psq, dsq) in sorted(mine.items()) for x in (float(t), psq, dsq)]

    def note(self, step: int, shard: int, sums: dict[int, tuple[float, float]]) -> None:
        """``shard``'s sums of squares of sync step ``step``, by tensor."""
        self._sums.setdefault(step, {})[shard] = sums

    def note_values(self, step: int, shard: int, values: Sequence[float]) -> None:
        """:meth:`note` from the flat list :meth:`begin` returns (what travels between shards)."""
        if len(values) % 3:
            raise ValueError(f"trust-ratio sums from shard {shard} hold {len(values)} values, not triples")
        self.note(step, shard, {int(values[k]): (values[k + 1], values[k + 2]) for k in range(0, len(values), 3)})

    def missing(self) -> list[int]:
        """The shards whose sums the step in progress still waits for (empty: it can finish)."""
        if self._step is None:
            return []
        got = self._sums.get(self._step, {})
        tensors = {self._pieces[i].index for i in self._begun}
        return sorted({s for t in tensors for s in self.holders[t] if t not in got.get(s, {})})

    @property
    def pending(self) -> bool:
        """Whether a step's first half ran and its second did not."""
        return self._step is not None

    def finish(self) -> None:
        """Second half: every begun piece takes its whole tensor's ratio (call when :meth:`missing` is empty)."""
        assert self._step is not None
        sums = self._sums.pop(self._step)
        for i, d in self._begun.items():
            m, t = self._masters[i], self._pieces[i].index
            # in shard order, so that every shard adds the same numbers in the same order (the same ratio, bit for bit)
            parts = [sums[s][t] for s in sorted(sums) if t in sums[s]]
            psq, dsq = sum(x for x, _ in parts), sum(x for _, x in parts)
            group = self._group_of[id(m)]
            ratio = direction_ratio(psq, dsq, d.scale, LAMB.hyper(group))
            with torch.no_grad():
                lamb_apply(m.detach(), self._scratch[i], d.scale, ratio, group["lr"])
        self.forget()

    def forget(self) -> None:
        """Drop the step in progress (an aborted sync step); later steps' sums already in are kept."""
        if self._step is not None:
            self._sums.pop(self._step, None)
        self._step = None
        self._begun = {}
