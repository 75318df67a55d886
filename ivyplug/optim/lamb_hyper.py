"""``LambHyper``: one LAMB step's hyperparameters, as every kernel takes them (torch loops, fused, compiled); and the
checks both LAMB twins (torch, Keras) run on them, so that they refuse the same values with the same words."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

#: Below this weight decay the kernels do not fold ``1/λ`` into the scratch buffer (``c/λ`` could overflow).
FOLD_MIN_DECAY = 1e-12


@dataclass(frozen=True)
class LambHyper:
    """The hyperparameters of one step of one param group (see :func:`ivyplug.optim.functional.lamb`).

    ``grad_scale`` multiplies every gradient (global norm clipping) inside the moment updates.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True
    max_trust_ratio: float = 10.0
    min_trust_ratio: float = 0.0
    exclude_from_layer_adaptation: bool = False
    grad_scale: float = 1.0

    @property
    def adapt(self) -> bool:
        """Whether the trust ratio applies (else it is 1: an AdamW-like update with L2-in-update decay)."""
        return not self.exclude_from_layer_adaptation

    @property
    def fold(self) -> bool:
        """Whether the kernels keep ``u/λ`` in their scratch buffer (else ``u/c``)."""
        return self.weight_decay >= FOLD_MIN_DECAY


def check_real(
    name: str, value: object, allowed: str, ok: Callable[[float], bool], *, allow_inf: bool = False
) -> float:
    """``float(value)`` where it is a real number (not a bool, not NaN, finite unless ``allow_inf``) that passes
    ``ok``; otherwise a ValueError naming ``name`` and what is ``allowed``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf) or not ok(number):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def check_eps(name: str, value: object, where: str = "") -> float:
    """LAMB's ``eps`` (Keras: ``epsilon``), in both twins and in a loaded state (``where``): a finite float > 0."""
    allowed = f"a finite float > 0 (with 0, an element whose gradients were all 0 divides 0 by 0){where}"
    return check_real(name, value, allowed, lambda x: x > 0)


def check_flag(name: str, value: object) -> bool:
    """``value`` where it is a bool; otherwise a ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_trust_bounds(min_trust_ratio: object, max_trust_ratio: object) -> tuple[float, float]:
    """The trust ratio's clip bounds as floats: ``0 <= min_trust_ratio <= max_trust_ratio`` (which may be inf)."""
    hi = check_real("max_trust_ratio", max_trust_ratio, "a float > 0 (inf allowed)", lambda x: x > 0, allow_inf=True)
    lo = check_real("min_trust_ratio", min_trust_ratio, "a finite float >= 0", lambda x: x >= 0)
    if lo > hi:
        raise ValueError(f"min_trust_ratio ({min_trust_ratio!r}) must be <= max_trust_ratio ({max_trust_ratio!r})")
    return lo, hi
