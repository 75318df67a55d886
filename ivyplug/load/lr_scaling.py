"""Learning-rate rescaling when the global batch size changes from B to B' (k = B'/B).

- ``"linear"``: lr × k (Goyal et al. 2017), the rule for SGD.
- ``"sqrt"``: lr × √k (Krizhevsky 2014; Hoffer et al. 2017), the rule for Adam-family optimizers and LAMB.
- ``"none"``: lr unchanged.
- ``"auto"``: chosen per optimizer by :func:`lr_rule_for` from its class and base classes.
"""

from __future__ import annotations

import math

RULES: tuple[str, ...] = ("auto", "sqrt", "linear", "none")

#: Lower-cased class names (the optimizer's own or a base class) -> rule.
_SQRT_NAMES = frozenset(
    {"adam", "adamw", "adamax", "nadam", "radam", "sparseadam", "lamb", "asynclamb", "fusedadam", "fusedlamb"}
)
_LINEAR_NAMES = frozenset({"sgd", "sgdw", "lars"})
_GENERIC_BASES = frozenset({"optimizer", "object", "baseoptimizer", "trackable", "autotrackable"})


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"lr_scaling must be one of {list(RULES)}, got {rule!r}")
    return rule


def lr_rule_for(optimizer: object) -> str:
    """``"sqrt"`` or ``"linear"`` for an optimizer instance, class or class name.

    Subclasses inherit their base's rule (a custom ``class MyAdam(torch.optim.Adam)`` is ``"sqrt"``), and a
    wrapper that holds the optimizer it steps as ``.optimizer`` (ivyplug's ``PSOptimizer``, Lightning's
    ``LightningOptimizer``) takes that optimizer's rule. An optimizer the rule table does not know is an error
    rather than a guess.
    """
    wrapped = getattr(optimizer, "optimizer", None) if not isinstance(optimizer, (str, type)) else None
    if wrapped is not None and wrapped is not optimizer and not isinstance(wrapped, (str, type)):
        return lr_rule_for(wrapped)
    if isinstance(optimizer, str):
        names = [optimizer]
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        names = [c.__name__ for c in cls.__mro__]
    for name in names:
        key = name.lower()
        if key in _SQRT_NAMES:
            return "sqrt"
        if key in _LINEAR_NAMES:
            return "linear"
    shown = next((n for n in names if n.lower() not in _GENERIC_BASES), names[0])
    raise ValueError(
        f"lr_scaling='auto' does not know optimizer {shown!r}: it knows Adam-family and LAMB (square-root rule) "
        "and SGD (linear rule); pass lr_scaling='sqrt', 'linear' or 'none' explicitly"
    )


def resolve_rule(rule: str, optimizer: object) -> str:
    """The concrete rule (``"sqrt"``, ``"linear"`` or ``"none"``) for ``optimizer``."""
    check_rule(rule)
    return lr_rule_for(optimizer) if rule == "auto" else rule


def lr_factor(old_batch_size: int, new_batch_size: int, rule: str) -> float:
    """The multiplier for the learning rate when B goes from ``old_batch_size`` to ``new_batch_size``."""
    for name, value in (("old_batch_size", old_batch_size), ("new_batch_size", new_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_rule(rule)
    if rule == "auto":
        raise ValueError("lr_factor needs a concrete rule ('sqrt', 'linear' or 'none'); resolve 'auto' first")
    k = new_batch_size / old_batch_size
    if rule == "linear":
        return k
    if rule == "sqrt":
        return math.sqrt(k)
    return 1.0
