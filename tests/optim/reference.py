"""An independent float64 NumPy LAMB, written straight from the formulas (You et al. 2020, Alg. 2).

Deliberately naive: no folding of constants, no scratch buffers, one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RefGroup:
    indices: list[int]
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    bias_correction: bool = True
    max_trust_ratio: float = 10.0
    min_trust_ratio: float = 0.0
    exclude_from_layer_adaptation: bool = False
    lr_at: Callable[[int], float] | None = None  # lr for step t (1-based), e.g. from a scheduler


@dataclass
class RefLamb:
    params: list[np.ndarray]
    groups: list[RefGroup]
    max_grad_norm: float | None = None
    m: list[np.ndarray] = field(init=False)
    v: list[np.ndarray] = field(init=False)
    t: int = 0
    ratios: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.params = [np.array(p, dtype=np.float64) for p in self.params]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]

    def step(self, grads: Sequence[np.ndarray]) -> None:
        grads = [np.asarray(g, dtype=np.float64) for g in grads]
        if not all(np.all(np.isfinite(g)) for g in grads):
            return
        self.t += 1
        t = self.t
        scale = 1.0
        if self.max_grad_norm is not None:
            total = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
            scale = min(1.0, self.max_grad_norm / (total + 1e-6))
        for grp in self.groups:
            b1, b2 = grp.betas
            lr = grp.lr_at(t) if grp.lr_at is not None else grp.lr
            for i in grp.indices:
                g = grads[i] * scale
                x = self.params[i]
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                if grp.bias_correction:
                    m_hat = self.m[i] / (1 - b1**t)
                    v_hat = self.v[i] / (1 - b2**t)
                else:
                    m_hat, v_hat = self.m[i], self.v[i]
                u = m_hat / (np.sqrt(v_hat) + grp.eps) + grp.weight_decay * x
                ratio = 1.0
                if not grp.exclude_from_layer_adaptation:
                    xn, un = np.linalg.norm(x), np.linalg.norm(u)
                    if xn > 0 and un > 0:
                        ratio = float(np.clip(xn / un, grp.min_trust_ratio, grp.max_trust_ratio))
                self.ratios[i] = ratio
                self.params[i] = x - lr * ratio * u
