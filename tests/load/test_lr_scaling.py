"""LR rules against the direct formulas, and automatic rule choice per optimizer."""

from __future__ import annotations

import math
import random

import pytest

from ivyplug.load import lr_factor, lr_rule_for, resolve_rule


def test_factors_follow_the_formulas_on_random_sizes() -> None:
    rng = random.Random(5)
    for _ in range(200):
        old, new = rng.randint(1, 4096), rng.randint(1, 4096)
        assert lr_factor(old, new, "linear") == pytest.approx(new / old, rel=1e-15)
        assert lr_factor(old, new, "sqrt") == pytest.approx(math.sqrt(new / old), rel=1e-15)
        assert lr_factor(old, new, "none") == 1.0
    assert lr_factor(32, 128, "sqrt") == 2.0 and lr_factor(32, 16, "linear") == 0.5
    # composing changes equals one change from the first to the last size
    assert lr_factor(8, 64, "sqrt") * lr_factor(64, 24, "sqrt") == pytest.approx(lr_factor(8, 24, "sqrt"))


def test_auto_rule_per_optimizer() -> None:
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert lr_rule_for(torch.optim.SGD(params, lr=0.1)) == "linear"
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax):
        assert lr_rule_for(cls) == "sqrt"

    class MyAdam(torch.optim.Adam):
        pass

    assert lr_rule_for(MyAdam) == "sqrt"
    assert lr_rule_for("LAMB") == "sqrt" and lr_rule_for("Lamb") == "sqrt" and lr_rule_for("SGD") == "linear"
    assert resolve_rule("auto", torch.optim.SGD) == "linear" and resolve_rule("none", torch.optim.SGD) == "none"
    with pytest.raises(ValueError, match=r"Adagrad.*lr_scaling='sqrt'"):
        lr_rule_for(torch.optim.Adagrad)


def test_a_wrapper_takes_the_rule_of_the_optimizer_it_wraps() -> None:
    """The PS's optimizer wrapper (what the Lightning strategy hands Lightning) has the wrapped optimizer's rule."""
    import torch

    from ivyplug.ps import PSClient, PSConfig, PSOptimizer

    w = torch.nn.Parameter(torch.zeros(3))
    for opt, rule in ((torch.optim.SGD([w], lr=0.1), "linear"), (torch.optim.AdamW([w]), "sqrt")):
        client = PSClient.start(PSConfig(mode="sync"), [("w", w)], optimizer=opt)
        try:
            assert lr_rule_for(PSOptimizer(opt, client)) == rule
        finally:
            client.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        lr_factor(1, 2, "cubic")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        lr_factor(1, 2, "auto")
    with pytest.raises(ValueError, match="old_batch_size"):
        lr_factor(0, 2, "sqrt")
