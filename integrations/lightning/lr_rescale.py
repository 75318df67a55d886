"""Rescale every optimizer's learning rate, and its schedulers' base rates, when the global batch size changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ivyplug.load.lr_scaling import lr_factor

#: the rates a param group holds for its schedulers: every one's start, OneCycleLR's peak and floor
_GROUP_RATES = ("initial_lr", "max_lr", "min_lr")


def rescale_lr(
    optimizers: Sequence[Any], scheduler_configs: Sequence[Any], rules: Sequence[str], old: int, new: int
) -> float:
    """Multiply each optimizer's ``lr`` (and the rates its schedulers start from and cycle to: ``initial_lr``,
    OneCycleLR's ``max_lr``/``min_lr``, ``base_lrs``, CyclicLR's ``max_lrs``) by its rule's factor for B going from
    ``old`` to ``new``, so a scheduler goes on from the rescaled rate; returns the first's factor."""
    first = 1.0
    for i, (opt, rule) in enumerate(zip(optimizers, rules, strict=True)):
        factor = lr_factor(old, new, rule)
        for group in opt.param_groups:
            group["lr"] *= factor
            for key in _GROUP_RATES:
                if key in group:
                    group[key] *= factor
        owners = (opt, getattr(opt, "optimizer", opt))  # a wrapper's (PSOptimizer's) schedulers hold what it wraps
        for config in scheduler_configs:
            scheduler = config.scheduler
            if any(getattr(scheduler, "optimizer", None) is o for o in owners):
                for name in ("base_lrs", "max_lrs"):  # every scheduler's start; CyclicLR's peaks
                    if hasattr(scheduler, name):
                        setattr(scheduler, name, [b * factor for b in getattr(scheduler, name)])
        if i == 0:
            first = factor
    return first
