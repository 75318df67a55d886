"""``lamb_param_groups``: the documented way to keep biases and norm layers out of adaptation and decay."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["lamb_param_groups"]


def lamb_param_groups(
    model: nn.Module,
    weight_decay: float = 0.01,
    exclude: Callable[[str, nn.Parameter], bool] | Iterable[str] | None = None,
    exclude_1d: bool = True,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into LAMB param groups.

    Excluded parameters get ``weight_decay=0.0`` and ``exclude_from_layer_adaptation=True`` (trust ratio 1): by
    default every parameter with fewer than 2 dimensions (biases, LayerNorm/BatchNorm weights), as in the LAMB
    paper's BERT setup. ``exclude`` adds more: a predicate ``(name, param) -> bool`` or glob patterns matched
    against the qualified name (``"*.bias"``, ``"embed*"``). Empty groups are omitted.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a float >= 0, got {weight_decay!r}")
    if exclude is None:
        predicate: Callable[[str, nn.Parameter], bool] = lambda name, p: False
    elif callable(exclude):
        predicate = exclude
    else:
        if isinstance(exclude, str):
            raise ValueError(f"exclude must be a list of glob patterns or a callable, got the string {exclude!r}")
        patterns = list(exclude)
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise ValueError(f"exclude patterns must be strings, got {pattern!r}")
        predicate = lambda name, p: any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
    adapted: list[nn.Parameter] = []
    excluded: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if (exclude_1d and p.ndim < 2) or predicate(name, p):
            excluded.append(p)
        else:
            adapted.append(p)
    groups: list[dict[str, Any]] = []
    if adapted:
        groups.append({"params": adapted, "weight_decay": float(weight_decay)})
    if excluded:
        groups.append({"params": excluded, "weight_decay": 0.0, "exclude_from_layer_adaptation": True})
    return groups
