"""``LAMB``: the torch.optim.Optimizer around :func:`ivyplug.optim.functional.lamb`.

``step()`` only gathers tensors and decides whether the step runs; the math lives in the functional kernels.

Policies (documented choices):

* **Non-finite gradients**: if any gradient holds NaN/Inf (or the global gradient norm overflows), the whole step
  is skipped: no parameter, moment or step counter changes, and :attr:`LAMB.skipped_steps` (saved in
  ``state_dict()``) counts it. This matches what mixed-precision loss scaling expects of an optimizer.
* **Gradient clipping**: ``max_grad_norm`` clips the global L2 norm over every gradient of this optimizer (all
  groups) with the coefficient ``min(1, max_grad_norm / (norm + 1e-6))`` of ``clip_grad_norm_``; the
  ``.grad`` tensors themselves are left untouched.
* **Kernel choice**: ``foreach=None`` resolves at the first step by the device rule of
  :func:`ivyplug.optim.functional.resolve_foreach`, and the resolved bool is written into the param group, so it
  is saved in ``state_dict()`` and a resumed run uses the same kernel. On CPU the multi-tensor kernel is the
  compiled one where a C compiler exists (``IVYPLUG_LAMB_KERNEL=auto|torch|compiled``, see
  :mod:`ivyplug.optim.compiled_kernel`), which also sums the gradient norm; the torch kernels otherwise.
* **Loading**: ``load_state_dict`` accepts what ``torch.optim.Adam`` accepts. A saved param group that lacks one
  of LAMB's hyperparameters (a hand-written or foreign checkpoint) keeps the value of the group it replaces, and
  a per-parameter ``step`` stored as a Python number becomes LAMB's 0-dim float32 counter.
* **Hooks**: step pre-/post-hooks run once per ``step()``, also in subclasses that extend ``step``: they call the
  unhooked :meth:`LAMB._lamb_step`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ivyplug.optim.functional import Workspace, global_grad_norm, lamb, resolve_foreach
from ivyplug.optim.lamb_hyper import LambHyper, check_eps, check_flag, check_real, check_trust_bounds

__all__ = ["LAMB"]

_CLIP_EPS = 1e-6

#: The constructor's defaults for every per-group key: what a group read from an old pickle means by a key it
#: lacks (``__setstate__`` fills ``defaults`` from here, then the groups from ``defaults``, as torch.optim does).
_GROUP_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-6,
    "weight_decay": 0.01,
    "bias_correction": True,
    "max_trust_ratio": 10.0,
    "min_trust_ratio": 0.0,
    "exclude_from_layer_adaptation": False,
    "foreach": None,
}


def _step_counter(value: object) -> Tensor:
    """LAMB's step counter (0-dim float32 on CPU, where the kernels read it) from a number or any tensor.

    torch.optim accepts a Python number here (checkpoints of older torch versions); the kernels need a tensor.
    """
    if isinstance(value, Tensor):
        if value.dtype == torch.float32 and value.device.type == "cpu" and value.dim() == 0:
            return value
        return value.detach().to(device="cpu", dtype=torch.float32).reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a LAMB step counter must be a number or a tensor, got {value!r}")
    return torch.tensor(float(value), dtype=torch.float32)


def _check_group(group: dict[str, Any]) -> None:
    """ValueError naming the first invalid hyperparameter of a param group (the Keras LAMB's checks and words)."""
    check_real("lr", group["lr"], "a finite float >= 0", lambda x: x >= 0)  # a tensor too is refused
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_real(f"betas[{i}]", b, "in [0, 1)", lambda x: 0.0 <= x < 1.0)
    check_eps("eps", group["eps"])
    check_real("weight_decay", group["weight_decay"], "a finite float >= 0", lambda x: x >= 0)
    check_trust_bounds(group["min_trust_ratio"], group["max_trust_ratio"])
    for name in ("bias_correction", "exclude_from_layer_adaptation"):
        check_flag(name, group[name])
    if group["foreach"] not in (None, True, False):
        raise ValueError(f"foreach must be None, True or False, got {group['foreach']!r}")


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al., ICLR 2020, Algorithm 2) with a clipped layer-wise trust ratio.

    ``m ← β1 m + (1−β1) g``; ``v ← β2 v + (1−β2) g²``; ``u = m̂/(√v̂+ε) + λx``;
    ``x ← x − η·clip(‖x‖/‖u‖, min_trust_ratio, max_trust_ratio)·u`` (ratio 1 when a norm is 0).

    Param groups may set ``exclude_from_layer_adaptation=True`` (ratio 1) and ``weight_decay=0.0``; build them
    with :func:`ivyplug.optim.lamb_param_groups`, whose ``exclude_from_weight_decay`` /
    ``exclude_from_layer_adaptation`` name patterns follow the Keras LAMB's rule (regular expressions searched in
    the name). See the module docstring for the NaN/Inf, clipping and kernel policies; :meth:`trust_ratios`
    returns the ratios of the last step.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: float = 10.0,
        min_trust_ratio: float = 0.0,
        max_grad_norm: float | None = None,
        foreach: bool | None = None,
    ) -> None:
        if max_grad_norm is not None:
            check_real("max_grad_norm", max_grad_norm, "None or a finite float > 0", lambda x: x > 0)
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "max_trust_ratio": max_trust_ratio,
            "min_trust_ratio": min_trust_ratio,
            "exclude_from_layer_adaptation": False,
            "foreach": foreach,
        }
        _check_group(defaults)
        self.max_grad_norm: float | None = None if max_grad_norm is None else float(max_grad_norm)
        #: Steps skipped because a gradient was not finite (saved in ``state_dict()``).
        self.skipped_steps = 0
        self._workspace = Workspace()
        self._last_ratios: list[tuple[list[Tensor], list[float | Tensor]]] = []
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also run by ``load_state_dict``: fills keys a group lacks and turns numeric steps into tensors."""
        super().__setstate__(state)
        for key, value in _GROUP_DEFAULTS.items():
            self.defaults.setdefault(key, value)
        for group in self.param_groups:
            for key in _GROUP_DEFAULTS:
                group.setdefault(key, self.defaults[key])
        for param_state in self.state.values():
            if isinstance(param_state, dict) and "step" in param_state:
                param_state["step"] = _step_counter(param_state["step"])
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("max_grad_norm", None)
        self._workspace = Workspace()
        self._last_ratios = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["skipped_steps"] = self.skipped_steps
        state["max_grad_norm"] = self.max_grad_norm
        return state

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load; a saved group keeps the replaced group's value for a hyperparameter it lacks.

        The replaced group holds what this optimizer was configured with (per group, e.g. by
        :func:`~ivyplug.optim.lamb_param_groups`), a better guess than the global defaults.
        """
        sd = dict(state_dict)
        skipped = int(sd.pop("skipped_steps", 0))
        saved_groups = sd.get("param_groups")
        for saved in saved_groups if isinstance(saved_groups, list) else []:
            if isinstance(saved, dict) and "eps" in saved:  # a state saved when eps=0 was still taken
                check_eps("eps", saved["eps"], " in a loaded state")
        if isinstance(saved_groups, list) and len(saved_groups) == len(self.param_groups):
            sd["param_groups"] = [
                {**{k: group[k] for k in _GROUP_DEFAULTS if k in group}, **saved} if isinstance(saved, dict) else saved
                for group, saved in zip(self.param_groups, saved_groups, strict=True)
            ]
        super().load_state_dict(sd)
        self.skipped_steps = skipped

    def _gather(
        self, group: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(
                    "LAMB does not support sparse gradients (got one for a parameter of shape "
                    f"{tuple(p.shape)}); use dense gradients, e.g. nn.Embedding(sparse=False)"
                )
            if p.is_complex():
                raise RuntimeError(f"LAMB does not support complex parameters (got {p.dtype})")
            exp_avg, exp_avg_sq, step = self.moments(p)
            params.append(p)
            grads.append(g)
            exp_avgs.append(exp_avg)
            exp_avg_sqs.append(exp_avg_sq)
            steps.append(step)
        return params, grads, exp_avgs, exp_avg_sqs, steps

    def moments(self, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``p``'s first and second moments and its step counter (zeros, created at its first step)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"], state["exp_avg_sq"], state["step"]

    @staticmethod
    def hyper(group: dict[str, Any], grad_scale: float = 1.0) -> LambHyper:
        """The hyperparameters of one step of ``group`` as the kernels take them."""
        beta1, beta2 = group["betas"]
        return LambHyper(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"],
            max_trust_ratio=group["max_trust_ratio"],
            min_trust_ratio=group["min_trust_ratio"],
            exclude_from_layer_adaptation=group["exclude_from_layer_adaptation"],
            grad_scale=grad_scale,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step over all groups, or none at all when a gradient is not finite."""
        return self._lamb_step(closure)

    @torch.no_grad()
    def _lamb_step(self, closure: Callable[[], float] | None = None) -> float | None:
        """The step without torch's hooks around it.

        torch wraps each class's ``step`` in its hook runner; a subclass whose ``step`` called ``super().step()``
        would run the hooks twice (once any LAMB exists), so subclasses call this instead.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        gathered = [self._gather(group) for group in self.param_groups]
        all_grads = [g for lists in gathered for g in lists[1]]
        if not all_grads:
            return loss
        total_norm = float(global_grad_norm(all_grads, self._workspace))
        if not math.isfinite(total_norm):
            self.skipped_steps += 1
            return loss
        grad_scale = 1.0
        if self.max_grad_norm is not None:
            grad_scale = min(1.0, self.max_grad_norm / (total_norm + _CLIP_EPS))
        last: list[tuple[list[Tensor], list[float | Tensor]]] = []
        for group, (params, grads, exp_avgs, exp_avg_sqs, steps) in zip(self.param_groups, gathered, strict=True):
            if not params:
                continue
            if group["foreach"] is None:
                group["foreach"] = resolve_foreach(None, params)
            hyper = dataclasses.asdict(self.hyper(group, grad_scale))  # lamb's keywords, by name
            ratios = lamb(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                foreach=group["foreach"],
                workspace=self._workspace,
                **hyper,
            )
            last.append((params, ratios))
        self._last_ratios = last
        return loss

    def trust_ratios(self) -> dict[Tensor, float]:
        """Trust ratio each parameter got in the last step that ran (1.0 where adaptation is excluded).

        Kept as the kernels produced them; converting to floats (a device sync on accelerators) happens only here.
        """
        out: dict[Tensor, float] = {}
        for params, ratios in self._last_ratios:
            for p, r in zip(params, ratios, strict=True):
                out[p] = float(r)
        return out
