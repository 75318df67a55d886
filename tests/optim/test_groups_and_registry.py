"""lamb_param_groups, the registry entry, lazy imports, and LAMB inside a Lightning Trainer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import ivyplug
from ivyplug.optim import LAMB, lamb_param_groups


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def _names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_exclude_1d_by_default() -> None:
    model = _Net()
    adapted, excluded = lamb_param_groups(model, weight_decay=0.05)
    assert _names(model, adapted["params"]) == {"embed.weight", "fc.weight", "head.weight"}
    assert adapted["weight_decay"] == 0.05 and "exclude_from_layer_adaptation" not in adapted
    assert _names(model, excluded["params"]) == {"fc.bias", "norm.weight", "norm.bias", "head.bias"}
    assert excluded["weight_decay"] == 0.0 and excluded["exclude_from_layer_adaptation"] is True
    opt = LAMB([adapted, excluded])
    assert opt.param_groups[1]["exclude_from_layer_adaptation"] is True
    assert opt.param_groups[0]["exclude_from_layer_adaptation"] is False


def test_param_groups_patterns_and_predicates() -> None:
    model = _Net()
    adapted, excluded = lamb_param_groups(
        model, exclude_from_weight_decay=["^embed"], exclude_from_layer_adaptation=["^embed"]
    )
    assert _names(model, adapted["params"]) == {"fc.weight", "head.weight"}
    assert "embed.weight" in _names(model, excluded["params"])
    (only,) = lamb_param_groups(model, exclude_1d=False)
    assert len(only["params"]) == 7  # the frozen layer is left out
    groups = lamb_param_groups(model, exclude=lambda name, p: name.startswith("head"), exclude_1d=False)
    assert _names(model, groups[1]["params"]) == {"head.weight", "head.bias"}
    with pytest.raises(ValueError, match="exclude"):
        lamb_param_groups(model, exclude="embed.*")
    with pytest.raises(ValueError, match="weight_decay"):
        lamb_param_groups(model, weight_decay=-1.0)
    with pytest.raises(ValueError, match="model"):
        lamb_param_groups([nn.Parameter(torch.zeros(1))])  # type: ignore[arg-type]


def test_registry_resolves_torch_lamb() -> None:
    registry = ivyplug.get_registry()
    assert "torch.lamb" in registry.names("optimizer")
    assert registry.get("optimizer", "torch.lamb") is LAMB
    assert issubclass(registry.get("optimizer", "torch.lamb"), torch.optim.Optimizer)


def test_plugin_and_package_import_no_torch() -> None:
    code = (
        "import sys, json, ivyplug.optim, ivyplug.optim.plugin\n"
        "print(json.dumps([m for m in ('torch', 'numpy') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_lamb_from_lightning_configure_optimizers() -> None:
    lightning = pytest.importorskip("lightning")
    pl = lightning.pytorch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> dict[str, object]:
            opt = LAMB(lamb_param_groups(self), lr=1e-2, max_grad_norm=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=gen), torch.randint(0, 3, (40,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=4,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    (opt,) = trainer.optimizers
    assert isinstance(opt, LAMB)
    assert trainer.global_step == 4
    assert all(opt.state[p]["step"].item() == 4 for p in module.parameters())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert set(opt.trust_ratios()) == set(module.parameters())


def test_param_groups_leave_the_decay_to_the_optimizer_unless_given() -> None:
    """``LAMB(lamb_param_groups(model), weight_decay=0.1)`` decays the adapted tensors by 0.1, not by a default of
    the groups' own; the excluded ones stay at 0.0, and an explicit value still wins."""
    model = _Net()
    adapted, excluded = lamb_param_groups(model)
    assert "weight_decay" not in adapted and excluded["weight_decay"] == 0.0
    opt = LAMB([adapted, excluded], weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert lamb_param_groups(model, weight_decay=0.02)[0]["weight_decay"] == 0.02
    with pytest.raises(ValueError, match=r"weight_decay must be None \(the optimizer's\) or a float >= 0, got -1"):
        lamb_param_groups(model, weight_decay=-1)
