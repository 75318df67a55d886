"""``LambHyper``: one LAMB step's hyperparameters, as every kernel takes them (torch loops, fused, compiled)."""

from __future__ import annotations

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
