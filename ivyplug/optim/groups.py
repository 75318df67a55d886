"""``lamb_param_groups``: the documented way to keep biases and norm layers out of adaptation and decay.

Name patterns follow one rule in torch and Keras: each is a regular expression searched anywhere in the name
(:func:`re.search`), so a plain word such as ``"bias"`` is a substring match. That is what Keras's own
``exclude_from_weight_decay(var_names=...)`` does and what torch code usually writes by hand
(``any(nd in name for nd in ["bias", "LayerNorm.weight"])``). torch names are qualified parameter names
(``encoder.0.bias``), Keras names variable paths, which begin with the model's name (``sequential/dense_1/bias``):
a pattern anchored with ``^`` therefore does not carry over between the two.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from ivyplug.name_patterns import check_patterns, matches_any

__all__ = ["lamb_param_groups", "matches_any"]

_warned_globs = False


def _legacy_globs(exclude: Iterable[str]) -> list[str]:
    """``exclude=[globs]`` of the previous release: still matched as globs, with one DeprecationWarning."""
    global _warned_globs
    patterns = list(exclude)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"exclude patterns must be strings, got {pattern!r}")
    if not _warned_globs:
        _warned_globs = True
        warnings.warn(
            "lamb_param_groups(exclude=[glob patterns]) is deprecated and will be removed in the next release; "
            "pass regular expressions searched in the name as exclude_from_weight_decay=[...] and "
            "exclude_from_layer_adaptation=[...] (the Keras LAMB's options and matching rule), e.g. "
            "exclude_from_weight_decay=['bias'] for exclude=['*bias*']",
            DeprecationWarning,
            stacklevel=3,
        )
    return patterns


def lamb_param_groups(
    model: nn.Module,
    weight_decay: float | None = None,
    exclude: Callable[[str, nn.Parameter], bool] | Iterable[str] | None = None,
    exclude_1d: bool = True,
    *,
    exclude_from_weight_decay: Sequence[str] | None = None,
    exclude_from_layer_adaptation: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into LAMB param groups.

    By default every parameter with fewer than 2 dimensions (biases, LayerNorm/BatchNorm weights) gets
    ``weight_decay=0.0`` and ``exclude_from_layer_adaptation=True`` (trust ratio 1), as in the LAMB paper's BERT
    setup. ``exclude_from_weight_decay`` and ``exclude_from_layer_adaptation`` add parameters to one exclusion
    each: lists of regular expressions searched in the qualified name (``["bias", r"norm\\."]``), the names and the
    rule of the Keras ``LAMB``'s options. ``exclude``, a predicate ``(name, param) -> bool``, adds to both; a list
    of glob patterns there is deprecated. Groups come adapted-and-decayed first; empty groups are omitted.
    ``weight_decay``: the decayed groups' value; ``None`` (default) leaves it to the optimizer's own
    ``weight_decay`` (``LAMB(lamb_param_groups(model), weight_decay=0.1)`` decays by 0.1).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weight_decay is not None and (
        isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0
    ):
        raise ValueError(f"weight_decay must be None (the optimizer's) or a float >= 0, got {weight_decay!r}")
    decay_patterns = check_patterns("exclude_from_weight_decay", exclude_from_weight_decay)
    layer_patterns = check_patterns("exclude_from_layer_adaptation", exclude_from_layer_adaptation)
    if exclude is None:
        predicate: Callable[[str, nn.Parameter], bool] = lambda name, p: False
    elif callable(exclude):
        predicate = exclude
    else:
        if isinstance(exclude, str):
            raise ValueError(f"exclude must be a callable (name, param) -> bool, got the string {exclude!r}")
        globs = _legacy_globs(exclude)
        predicate = lambda name, p: any(fnmatch.fnmatchcase(name, pat) for pat in globs)
    # (adapted, decayed) -> parameters; the key order is the group order
    split: dict[tuple[bool, bool], list[nn.Parameter]] = {
        (True, True): [],
        (True, False): [],
        (False, True): [],
        (False, False): [],
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        both = (exclude_1d and p.ndim < 2) or predicate(name, p)
        adapted = not (both or matches_any(layer_patterns, name))
        decayed = not (both or matches_any(decay_patterns, name))
        split[(adapted, decayed)].append(p)
    groups: list[dict[str, Any]] = []
    for (adapted, decayed), params in split.items():
        if not params:
            continue
        group: dict[str, Any] = {"params": params}
        if not decayed:
            group["weight_decay"] = 0.0
        elif weight_decay is not None:
            group["weight_decay"] = float(weight_decay)
        if not adapted:
            group["exclude_from_layer_adaptation"] = True
        groups.append(group)
    return groups
