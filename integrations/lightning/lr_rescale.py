"""Rescale every optimizer's learning rate, and its schedulers' base rates, when the global batch size changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ivyplug.load.lr_scaling import lr_factor


def rescale_lr(
    optimizers: Sequence[Any], scheduler_configs: Sequence[Any], rules: Sequence[str], old: int, new: int
) -> float:
    """Multiply each optimizer's ``lr`` (and ``initial_lr``, and its schedulers' ``base_lrs``) by its rule's factor
    for B going from ``old`` to ``new``, so a scheduler goes on from the rescaled rate; returns the first's factor."""
    first = 1.0
    for i, (opt, rule) in enumerate(zip(optimizers, rules, strict=True)):
        factor = lr_factor(old, new, rule)
        for group in opt.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        owners = (opt, getattr(opt, "optimizer", opt))  # a wrapper's (PSOptimizer's) schedulers hold what it wraps
        for config in scheduler_configs:
            scheduler = config.scheduler
            if any(getattr(scheduler, "optimizer", None) is o for o in owners) and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]
        if i == 0:
            first = factor
    return first
