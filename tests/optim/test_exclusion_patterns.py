"""lamb_param_groups name patterns: regular expressions searched in the name (the Keras LAMB's rule), one
exclusion each, and the old glob form of ``exclude`` kept for one release with a DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from ivyplug.optim import groups as groups_module
from ivyplug.optim import lamb_param_groups


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _names(model: nn.Module, group: dict[str, object]) -> set[str]:
    ids = {id(p) for p in group["params"]}  # type: ignore[attr-defined]
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_each_pattern_list_excludes_from_its_own_rule_only() -> None:
    model = _model()
    groups = lamb_param_groups(
        model,
        weight_decay=0.1,
        exclude_1d=False,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=[r"^1\."],
    )
    by_kind = {(g["weight_decay"], g.get("exclude_from_layer_adaptation", False)): _names(model, g) for g in groups}
    assert by_kind == {
        (0.1, False): {"0.weight", "2.weight"},
        (0.0, False): {"0.bias", "2.bias"},
        (0.1, True): {"1.weight"},
        (0.0, True): {"1.bias"},
    }
    # adapted-and-decayed first, fully excluded last
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1, 0.0]


@pytest.mark.parametrize("bad", ["bias", ["("], [""], [3]])
def test_bad_patterns_name_the_option(bad: object) -> None:
    with pytest.raises(ValueError, match="exclude_from_weight_decay"):
        lamb_param_groups(_model(), exclude_from_weight_decay=bad)  # type: ignore[arg-type]


def test_glob_exclude_still_works_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(groups_module, "_warned_globs", False)
    model = _model()
    with pytest.warns(DeprecationWarning, match="exclude_from_weight_decay") as record:
        _, excluded = lamb_param_groups(model, exclude=["*.bias"], exclude_1d=False)
    assert len([w for w in record if issubclass(w.category, DeprecationWarning)]) == 1
    assert _names(model, excluded) == {"0.bias", "1.bias", "2.bias"}
    assert excluded["weight_decay"] == 0.0 and excluded["exclude_from_layer_adaptation"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use is silent
        lamb_param_groups(model, exclude=["*.bias"])
