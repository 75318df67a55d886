"""Mirror the user's optimizer on a server shard: same class, same per-group hyperparameters.

Hyperparameters travel with every push as a small fp64 vector (not pickled): every numeric entry of
every param group (floats, ints, tuples of numbers such as ``betas``, 0-d tensors such as a tensor
``lr``). Booleans, strings and ``None`` are copied once at start. So an LR scheduler that edits
``param_groups[i]["lr"]`` on the workers changes the servers' update at the next push.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def _elementwise_classes() -> tuple[type, ...]:
    names = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def is_elementwise(optimizer_cls: type) -> bool:
    """Whether ``optimizer_cls``'s update of an element depends only on that element (and per-group scalars).

    Only then can a tensor be split across servers without changing the update. Exact classes only: a
    subclass may add layer-wise statistics, and LAMB (trust ratio per tensor) or Adafactor (row/column
    factors) are not element-wise.
    """
    return optimizer_cls in _elementwise_classes()


@dataclass(frozen=True)
class _Slot:
    group: int
    key: str
    kind: str  # "float" | "int" | "tuple" | "tensor"
    length: int


#: Group keys that choose how an optimizer computes its step, not what it computes: each server chooses for its own
#: tensors (LAMB records its resolved ``foreach``, so a DDP checkpoint's groups differ there from a fresh PS's).
KERNEL_CHOICES = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _slot_kind(value: Any) -> tuple[str, int] | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        return ("float", 1)
    if isinstance(value, int):
        return ("int", 1)
    if isinstance(value, torch.Tensor):
        return ("tensor", 1) if value.numel() == 1 else None
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return ("tuple", len(value))
    return None


def _unchanged(value: Any, start: Any) -> bool:
    """Whether a value copied once at start is still the same: the same object, or an equal plain value (a
    tensor or array put in its place compares element-wise, so only identity counts for those)."""
    if value is start:
        return True
    plain = (bool, int, float, str, type(None))
    return isinstance(value, plain) and isinstance(start, plain) and value == start


@dataclass
class OptimizerSpec:
    """What a server needs to build the user's optimizer over its shard and follow its hyperparameters."""

    cls: type
    ctor_kwargs: dict[str, Any]
    groups: list[dict[str, Any]]
    param_group: list[int]  # per parameter index: its group, -1 if the optimizer does not hold it
    slots: list[_Slot] = field(default_factory=list)

    @classmethod
    def from_optimizer(cls, optimizer: Any, params: Sequence[torch.Tensor]) -> OptimizerSpec:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer (its class is mirrored on the servers), "
                f"got {type(optimizer).__name__}"
            )
        where: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                where[id(p)] = g
        param_group = [where.get(id(p), -1) for p in params]
        if all(g < 0 for g in param_group) and params:
            raise ValueError("optimizer holds none of the given params (pass the optimizer built over these params)")
        for group in [*optimizer.param_groups, {"max_grad_norm": getattr(optimizer, "max_grad_norm", None)}]:
            if group.get("max_grad_norm") is not None:
                raise ValueError(
                    "the optimizer sets max_grad_norm; a sharded server would clip per shard, not globally. Set "
                    "max_grad_norm=None and clip the global norm instead: with Lightning Trainer(gradient_clip_val="
                    "..., gradient_clip_algorithm='norm'), with a PSClient of your own PSClient.step(max_grad_norm=...)"
                )
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        try:
            sig = inspect.signature(type(optimizer).__init__)
            accepted = set(sig.parameters)
            var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        except (TypeError, ValueError):
            accepted, var_kw = set(), True
        ctor_kwargs = {k: v for k, v in optimizer.defaults.items() if var_kw or k in accepted}
        slots: list[_Slot] = []
        for g, hp in enumerate(groups):
            for key in sorted(hp):
                sk = _slot_kind(hp[key])
                if sk is not None:
                    slots.append(_Slot(g, key, sk[0], sk[1]))
        return cls(type(optimizer), ctor_kwargs, groups, param_group, slots)

    @property
    def num_values(self) -> int:
        return sum(s.length for s in self.slots)

    def encode(self, optimizer: Any) -> torch.Tensor:
        """The live numeric hyperparameters of ``optimizer`` as fp64 (exact for floats and ints < 2**53)."""
        vals: list[float] = []
        for s in self.slots:
            v = optimizer.param_groups[s.group][s.key]
            if s.kind == "tuple":
                vals.extend(float(x) for x in v)
            else:
                vals.append(float(v.item()) if isinstance(v, torch.Tensor) else float(v))
        return torch.tensor(vals, dtype=torch.float64)

    def unmirrored_changes(self, optimizer: Any) -> list[str]:
        """What changed in ``optimizer``'s groups since start that the servers cannot follow (empty: nothing).

        Numeric values travel with every push; a key added since (a scheduler created later, say) and a
        non-numeric value changed since (``nesterov`` turned on) do not; a kernel choice (:data:`KERNEL_CHOICES`)
        is each server's own. A group added or removed changes
        which parameters the servers step: that raises, since training would silently leave them out.
        """
        live = optimizer.param_groups
        if len(live) != len(self.groups):
            raise ValueError(
                f"the optimizer has {len(live)} param groups, but it had {len(self.groups)} when the PS started: the "
                "servers step the groups they were given (add every group before fit, e.g. in configure_optimizers)"
            )
        changes = []
        for g, (group, start) in enumerate(zip(live, self.groups, strict=True)):
            for key, value in group.items():
                if key == "params" or key in KERNEL_CHOICES:
                    continue
                if key not in start:
                    changes.append(f"param group {g} gained {key!r}")
                elif _slot_kind(start[key]) is None and not _unchanged(value, start[key]):
                    changes.append(f"param group {g}'s {key!r} changed from {start[key]!r} to {value!r}")
        return changes

    def decode_into(self, values: torch.Tensor, groups: dict[int, dict[str, Any]]) -> None:
        """Write ``values`` into the server optimizer's groups (``groups``: user group index -> group)."""
        if values.numel() != self.num_values:
            raise ValueError(f"hyperparameter vector has {values.numel()} values, expected {self.num_values}")
        vals = values.tolist()
        i = 0
        for s in self.slots:
            chunk = vals[i : i + s.length]
            i += s.length
            target = groups.get(s.group)
            if target is None:
                continue
            if s.kind == "float":
                target[s.key] = chunk[0]
            elif s.kind == "int":
                target[s.key] = int(chunk[0])
            elif s.kind == "tuple":
                target[s.key] = tuple(chunk)
            else:
                cur = target[s.key]
                if isinstance(cur, torch.Tensor):
                    cur.fill_(chunk[0])
                else:
                    target[s.key] = chunk[0]

    def build(self, masters_by_group: dict[int, list[torch.Tensor]]) -> tuple[Any, dict[int, dict[str, Any]]]:
        """Construct the optimizer class over the shard's masters; returns it and user-group -> its group."""
        order = sorted(g for g, ts in masters_by_group.items() if ts and g >= 0)
        if not order:
            return None, {}
        param_groups = []
        for g in order:
            hp = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.groups[g].items()}
            param_groups.append({"params": masters_by_group[g], **hp})
        opt = self.cls(param_groups, **self.ctor_kwargs)
        return opt, {g: opt.param_groups[i] for i, g in enumerate(order)}
