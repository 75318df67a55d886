"""Independent float64 NumPy outer optimizers, written straight from the formulas in docs/design.md.

Each takes the global copy's layers and, per merge, the pseudo-gradient g = x_pulled − x_local (= −Δ) of every
layer; a merge whose pseudo-gradient holds a NaN/Inf is dropped whole (the PS's ``nonfinite="skip"``).
Deliberately naive: one layer at a time, no in-place tricks. LAMB is tests/optim/reference.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tests.optim.reference import RefGroup, RefLamb


def _finite(grads: Sequence[np.ndarray]) -> bool:
    return all(bool(np.all(np.isfinite(g))) for g in grads)


@dataclass
class RefAverage:
    """x ← x − rate · g  (= x + rate · Δ)."""

    params: list[np.ndarray]
    rate: float

    def __post_init__(self) -> None:
        self.params = [np.array(p, dtype=np.float64) for p in self.params]

    def merge(self, grads: Sequence[np.ndarray]) -> None:
        if _finite(grads):
            self.params = [x - self.rate * np.asarray(g, np.float64) for x, g in zip(self.params, grads, strict=True)]


@dataclass
class RefDelayedNesterov:
    """Per merge k: a += g; k mod N ≠ 0: x −= lr·g/N; else m = β·m + a/N, x −= lr·(g/N + β·m), a = 0."""

    params: list[np.ndarray]
    lr: float
    beta: float
    every: int = 1
    k: int = 0
    m: list[np.ndarray] = field(init=False)
    a: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.params = [np.array(p, dtype=np.float64) for p in self.params]
        self.m = [np.zeros_like(p) for p in self.params]
        self.a = [np.zeros_like(p) for p in self.params]

    def merge(self, grads: Sequence[np.ndarray]) -> None:
        if not _finite(grads):
            return
        self.k += 1
        n = self.every
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            self.a[i] = self.a[i] + g
            if self.k % n:
                self.params[i] = self.params[i] - self.lr * g / n
            else:
                self.m[i] = self.beta * self.m[i] + self.a[i] / n
                self.a[i] = np.zeros_like(g)
                self.params[i] = self.params[i] - self.lr * (g / n + self.beta * self.m[i])


class RefOuterLamb(RefLamb):
    """tests/optim/reference.py's LAMB stepped with the pseudo-gradient (it skips a non-finite one)."""

    def merge(self, grads: Sequence[np.ndarray]) -> None:
        self.step(grads)


def ref_lamb(params: Sequence[np.ndarray], lr: float, beta1: float, max_trust_ratio: float) -> RefOuterLamb:
    """The outer LAMB: β2 0.999, ε 1e-6, no weight decay, bias correction, trust ratio in [0, max_trust_ratio]."""
    group = RefGroup(
        indices=list(range(len(params))),
        lr=lr,
        betas=(beta1, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        bias_correction=True,
        max_trust_ratio=max_trust_ratio,
        min_trust_ratio=0.0,
    )
    return RefOuterLamb(list(params), [group])
