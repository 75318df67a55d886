"""The PS step as an optimizer: ``PSOptimizer.step(closure)`` runs the closure, pushes, pulls.

Like torch's ``PostLocalSGDOptimizer`` and hivemind's ``Optimizer``, it wraps the optimizer a training loop
already holds, so the loop calls ``step`` as it always does (Lightning's precision plugins and manual
optimization included) and the PS takes the step: the wrapped optimizer never steps itself, the servers
mirror its class and param groups, and the hyperparameters of its groups travel with every push (an LR
scheduler bound to it works as usual).

Several optimizers (a GAN's generator and discriminator) share one PS client: :func:`served_optimizer` joins
their param groups into the one optimizer the servers mirror, and each :class:`PSOptimizer` pushes only its
own parameters' gradients, so a step of one leaves the others' parameters as they are on the servers, as a
step of one torch optimizer leaves the others' parameters alone.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ivyplug.ps.worker.client import PSClient


def served_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer the servers mirror for ``optimizers``: the optimizer itself, or for several, one of
    their class holding every optimizer's param groups (the same group dicts, so schedulers move both).

    Several optimizers must be of one class and share no parameter (ValueError naming them otherwise).
    """
    if not optimizers:
        raise ValueError("optimizers must hold at least one optimizer")
    if len(optimizers) == 1:
        return optimizers[0]
    classes = sorted({type(o).__name__ for o in optimizers})
    if len(classes) > 1:
        raise ValueError(
            "several optimizers under the PS must be of one class, since the servers mirror one optimizer that "
            f"holds every optimizer's param groups; got {', '.join(classes)}"
        )
    seen: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen and seen[id(p)] != k:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizers {seen[id(p)]} and {k}: under the "
                        "PS each parameter belongs to one optimizer"
                    )
                seen[id(p)] = k
    union = copy.copy(optimizers[0])  # an optimizer of their class, never stepped: what the servers mirror
    union.param_groups = [group for opt in optimizers for group in opt.param_groups]
    union.state = collections.defaultdict(dict)
    return union


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler bound to ``optimizer`` that it stepped (the servers stepped its mirror): torch's
    schedulers warn about a scheduler step before an optimizer step otherwise."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's flag for that check


class PSOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer whose steps the PS servers take: ``step(closure)`` runs the closure, pushes this
    optimizer's gradients, waits as the PS mode says and pulls the global parameters.

    Args:
        optimizer: the optimizer to wrap; it never steps itself, the servers mirror it. It must be
            the client's served optimizer or one of those :func:`served_optimizer` joined into it.
        client: the started :class:`~ivyplug.ps.PSClient` over the model's parameters.
        num_samples: called at each step for the samples this step's gradients were made from (sync mode
            weights each worker's push by it); ``None``: 1.
        max_grad_norm: called after the closure at each step for the gradient norm to clip to (sync mode:
            the combined gradient's, on the servers; async/ssp: this push's), or None; ``None``: no clipping.
        clip_value: the same for element-wise clipping to ``[-v, v]`` (sync mode: the combined gradient, on the
            servers, as DDP clamps the averaged gradient).

    Example:
        >>> import torch
        >>> from ivyplug.ps import PSClient, PSConfig
        >>> from ivyplug.ps.worker.optimizer import PSOptimizer
        >>> model = torch.nn.Linear(3, 1)
        >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> client = PSClient.start(PSConfig(mode="sync"), list(model.named_parameters()), optimizer=sgd)
        >>> opt = PSOptimizer(sgd, client)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = model(torch.ones(2, 3)).pow(2).mean()
        ...     loss.backward()
        ...     return loss
        >>> before = model.weight.detach().clone()
        >>> _ = opt.step(closure)
        >>> bool((model.weight != before).all())  # the server stepped, the worker pulled
        True
        >>> client.close()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        client: PSClient,
        *,
        num_samples: Callable[[], int] | None = None,
        max_grad_norm: Callable[[], float | None] | None = None,
        clip_value: Callable[[], float | None] | None = None,
    ) -> None:
        mine = [p for group in optimizer.param_groups for p in group["params"]]
        served = {id(p) for group in client.optimizer.param_groups for p in group["params"]}
        if not all(id(p) in served for p in mine):
            raise ValueError("optimizer has parameters the PS client's optimizer does not hold (see served_optimizer)")
        self.optimizer = optimizer
        self.client = client
        self.defaults = optimizer.defaults
        # one of several optimizers pushes only its own parameters; the served one itself, every parameter
        self._params: list[torch.Tensor] | None = None if client.optimizer is optimizer else mine
        self._num_samples = num_samples if num_samples is not None else (lambda: 1)
        self._max_grad_norm = max_grad_norm if max_grad_norm is not None else (lambda: None)
        self._clip_value = clip_value if clip_value is not None else (lambda: None)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # the wrapped optimizer's
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # the wrapped optimizer's (it stays empty: the servers step)
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward and backward) if given, then push, wait and pull; returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.client.step(
            num_samples=self._num_samples(),
            max_grad_norm=self._max_grad_norm(),
            clip_value=self._clip_value(),
            params=self._params,
        )
        mark_stepped(self.optimizer)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's (its hyperparameters; its state lives on the servers: PSClient.state_dict)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "PSOptimizer cannot take a new param group: the servers' mirror of the optimizer is fixed when the PS "
            "starts (add the group before starting it; to train some parameters later, as fine-tuning callbacks "
            "do, put them in the optimizer from the start and freeze them with requires_grad_(False): a parameter "
            "without a gradient is not stepped)"
        )

    def __repr__(self) -> str:
        return f"PSOptimizer({self.optimizer!r})"
