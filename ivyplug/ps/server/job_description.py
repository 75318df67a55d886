"""What the first worker hands an ``ivyplug serve``: the model's tensors, the optimizer, the consistency mode.

A description is a plain dict of names, shapes, numbers and strings (and 0-d tensors for tensor
hyperparameters), sent in the typed encoding of wire/typed_state.py: nothing in it is unpickled, and the
optimizer class travels as a name that the server resolves only among ``torch.optim`` and
``ivyplug.optim`` (importing an arbitrary module named by a peer would run its code). A later worker's
description must match the servers' in everything but the hyperparameters that travel with each push
(learning rates that a scheduler changes); :func:`difference` names the first mismatch.
"""

from __future__ import annotations

from typing import Any

import torch

from ivyplug.ps.config import PSConfig
from ivyplug.ps.server.mirror import OptimizerSpec, _Slot
from ivyplug.ps.sharding import ShardPlan, TensorSpec, build_plan

FORMAT = "ivyplug.job/1"
_MODULES = ("torch.optim", "ivyplug.optim")


def optimizer_name(cls: type) -> str:
    """``"torch.optim.AdamW"``: the public name under which a server can build ``cls``."""
    import ivyplug.optim

    for module_name, module in (("torch.optim", torch.optim), ("ivyplug.optim", ivyplug.optim)):
        if getattr(module, cls.__name__, None) is cls:
            return f"{module_name}.{cls.__name__}"
    raise ValueError(
        f"ivyplug serve can build optimizers of {list(_MODULES)} only, got {cls.__module__}.{cls.__qualname__} "
        "(a server never imports a module a peer names)"
    )


def optimizer_class(name: object) -> type:
    """Inverse of :func:`optimizer_name` (ValueError for anything else)."""
    import ivyplug.optim

    if isinstance(name, str):
        module_name, _, attr = name.rpartition(".")
        module = {"torch.optim": torch.optim, "ivyplug.optim": ivyplug.optim}.get(module_name)
        cls = getattr(module, attr, None) if module is not None and not attr.startswith("_") else None
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return cls
    raise ValueError(f"unknown optimizer {name!r}: ivyplug serve builds optimizers of {list(_MODULES)} only")


def describe(cfg: PSConfig, plan: ShardPlan, spec: OptimizerSpec) -> dict[str, Any]:
    """The description of a worker's job (see the module docstring)."""
    return {
        "format": FORMAT,
        "mode": cfg.mode,
        "staleness": cfg.staleness,
        "staleness_scaling": cfg.staleness_scaling,
        "nonfinite": cfg.nonfinite,
        "max_shard_bytes": plan.max_shard_bytes,
        "plan_signature": plan.signature(),
        "tensors": [[s.name, list(s.shape), s.kind, s.is_float] for s in plan.specs],
        "optimizer": {
            "class": optimizer_name(spec.cls),
            "ctor_kwargs": dict(spec.ctor_kwargs),
            "groups": [dict(g) for g in spec.groups],
            "param_group": list(spec.param_group),
            "slots": [[s.group, s.key, s.kind, s.length] for s in spec.slots],
        },
    }


def _fixed(desc: dict[str, Any]) -> dict[str, Any]:
    """The parts that must match between workers (numeric hyperparameters travel with every push), in the order a
    refusal names the first that differs: the optimizer before ``max_shard_bytes``, which "auto" derives from it."""
    opt = desc["optimizer"]
    numeric = {(g, k) for g, k, _, _ in opt["slots"]}
    groups = [
        {k: v for k, v in grp.items() if (g, k) not in numeric and not isinstance(v, torch.Tensor)}
        for g, grp in enumerate(opt["groups"])
    ]
    return {
        "mode": desc["mode"],
        "staleness": desc["staleness"],
        "staleness_scaling": desc["staleness_scaling"],
        "nonfinite": desc["nonfinite"],
        "optimizer class": opt["class"],
        "max_shard_bytes": desc["max_shard_bytes"],
        "optimizer param groups (non-numeric settings)": groups,
        "optimizer's parameter-to-group map": opt["param_group"],
        "optimizer's numeric hyperparameters": [[g, k, kind, n] for g, k, kind, n in opt["slots"]],
    }


def difference(job: dict[str, Any], other: dict[str, Any]) -> str | None:
    """The first way ``other`` (a joining worker) differs from ``job`` (the servers'), or None."""
    if other.get("format") != FORMAT:
        return f"its description format is {other.get('format')!r}, the servers' {FORMAT!r}"
    mine, theirs = job["tensors"], other["tensors"]
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if list(a) != list(b):
            return (
                f"tensor {i} is {b[0]!r} of shape {tuple(b[1])} ({b[2]}), the servers' model has {a[0]!r} of shape "
                f"{tuple(a[1])} ({a[2]})"
            )
    if len(mine) != len(theirs):
        return f"its model has {len(theirs)} tensors, the servers' {len(mine)}"
    fa, fb = _fixed(job), _fixed(other)
    for key in fa:
        if fa[key] != fb[key]:
            return f"its {key} is {fb[key]!r}, the servers' {fa[key]!r}"
    return None


def build(desc: dict[str, Any], num_shards: int, timeout: float) -> tuple[PSConfig, ShardPlan, OptimizerSpec]:
    """The servers' config, plan and optimizer spec from a description (ValueError if it is malformed)."""
    try:
        if desc.get("format") != FORMAT:
            raise ValueError(f"description format {desc.get('format')!r}, expected {FORMAT!r}")
        cfg = PSConfig(
            mode=desc["mode"],
            staleness=desc["staleness"],
            staleness_scaling=desc["staleness_scaling"],
            nonfinite=desc["nonfinite"],
            timeout=timeout,
            max_shard_bytes=desc["max_shard_bytes"],
        )
        specs = [
            TensorSpec(str(n), tuple(int(d) for d in shape), str(kind), bool(f))
            for n, shape, kind, f in desc["tensors"]
        ]
        if len({s.name for s in specs}) != len(specs) or any(s.kind not in ("param", "buffer") for s in specs):
            raise ValueError("tensor names must be unique and kinds 'param' or 'buffer'")
        plan = build_plan(specs, num_shards, cfg.max_shard_bytes)
        if plan.signature() != desc["plan_signature"]:
            raise ValueError("the plan built here differs from the worker's (another ivyplug version?)")
        opt = desc["optimizer"]
        spec = OptimizerSpec(
            optimizer_class(opt["class"]),
            dict(opt["ctor_kwargs"]),
            [dict(g) for g in opt["groups"]],
            [int(g) for g in opt["param_group"]],
            [_Slot(int(g), str(k), str(kind), int(n)) for g, k, kind, n in opt["slots"]],
        )
        if len(spec.param_group) != plan.num_params:
            raise ValueError("the optimizer's parameter-to-group map does not cover the model's parameters")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed job description: {type(exc).__name__}: {exc}") from None
    return cfg, plan, spec
