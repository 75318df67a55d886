"""Constructor validation and the refusals that happen in the main process, before any worker starts."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from ivyplug.integrations.lightning import IvyPSStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.plugins import MixedPrecision

from .digits import DigitsMLP


class _DigitsWithBatchNorm(DigitsMLP):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"find_unused_parameters": True}, "unknown keyword argument.*find_unused_parameters"),
        ({"mode": "bsp"}, "mode must be one of"),
        ({"mode": "ssp"}, "staleness must be an int"),
        ({"mode": "ssp", "staleness": -1}, "staleness must be >= 0"),
        ({"mode": "async", "staleness": 2}, "staleness is only meaningful"),
        ({"staleness_scaling": "sqrt"}, "staleness_scaling must be one of"),
        ({"timeout": 0}, "timeout must be a finite number"),
        ({"timeout": timedelta(seconds=3)}, "timeout must be a finite number"),
        ({"num_servers": -1}, "num_servers must be an int"),
        ({"max_shard_bytes": 0}, "max_shard_bytes must be .auto., None or an int"),
        ({"start_method": "thread"}, "start_method must be one of"),
        ({"process_group_timeout": 30}, "process_group_timeout must be a datetime.timedelta"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IvyPSStrategy(**kwargs)


def test_defaults_and_valid_arguments() -> None:
    s = IvyPSStrategy()
    assert (s.mode, s.ps_config.staleness, s.ps_config.staleness_scaling, s.ps_config.num_servers) == (
        "async",
        None,
        "inverse",
        0,
    )
    assert s.ps_config.timeout == 120.0
    s = IvyPSStrategy(mode="ssp", staleness=0, timeout=5, process_group_timeout=timedelta(seconds=60))
    assert (s.mode, s.ps_config.staleness, s.ps_config.timeout) == ("ssp", 0, 5)


def _trainer(mode: str, **kwargs: Any) -> Trainer:
    kwargs.setdefault("callbacks", [])
    return Trainer(
        strategy=IvyPSStrategy(mode=mode, start_method="spawn", staleness=1 if mode == "ssp" else None),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    "mode, trainer_kwargs, model_cls, match",
    [
        ("async", {"val_check_interval": 0.5}, DigitsMLP, r"val_check_interval=0\.5"),
        ("ssp", {"val_check_interval": 3}, DigitsMLP, r"val_check_interval=3"),
        ("async", {"val_check_interval": "00:00:00:05"}, DigitsMLP, "time-based val_check_interval"),
        ("async", {"max_time": "00:00:01:00"}, DigitsMLP, "Timer checked every step"),
        ("async", {"callbacks": [ModelCheckpoint(every_n_train_steps=5)]}, DigitsMLP, "every_n_train_steps=5"),
        (
            "async",
            {"callbacks": [ModelCheckpoint(train_time_interval=timedelta(seconds=5))]},
            DigitsMLP,
            "train_time_interval",
        ),
        ("async", {"sync_batchnorm": True}, DigitsMLP, "sync_batchnorm"),
        ("async", {"max_steps": 10, "min_epochs": 2}, DigitsMLP, "max_steps together with min_steps/min_epochs"),
        ("ssp", {"max_steps": 10, "min_steps": 5}, DigitsMLP, "max_steps together with min_steps/min_epochs"),
        # in any mode: it refused these only after both workers had started
        ("sync", {"callbacks": [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]}, DigitsMLP, "BackboneFinetuning"),
        # the average and the re-estimated statistics were overwritten by the servers' copy in the extra epoch
        (
            "async",
            {"callbacks": [StochasticWeightAveraging(swa_lrs=1e-3)]},
            _DigitsWithBatchNorm,
            "cannot run StochasticWeightAveraging on a model with BatchNorm layers",
        ),
        (
            "async",
            {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]},
            DigitsMLP,
            "does not support loss scaling",
        ),
    ],
)
def test_fit_refused_before_spawning(
    mode: str, trainer_kwargs: dict[str, Any], model_cls: type, match: str, tmp_path: Any
) -> None:
    trainer = _trainer(mode, default_root_dir=str(tmp_path), **trainer_kwargs)
    before = multiprocessing.active_children()
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        trainer.fit(model_cls())
    assert [p for p in multiprocessing.active_children() if p not in before] == []  # this fit started none
    assert time.monotonic() - start < 30  # refused up front, not after a worker timed out


def test_sync_mode_allows_per_step_options() -> None:
    strategy = IvyPSStrategy(mode="sync", start_method="spawn")
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        val_check_interval=0.5,
        max_time="00:00:01:00",
        max_steps=10,
        min_epochs=2,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.state.fn = "fit"
    strategy.check_fit_configuration(trainer, DigitsMLP())  # no error


def test_project_defaults_from_pyproject_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[tool.ivyplug.ps] configures Trainer(strategy="ivy_ps") without code; arguments and variables win."""
    (tmp_path / "pyproject.toml").write_text('[tool.ivyplug.ps]\ntimeout = 300\nstaleness_scaling = "none"\n')
    monkeypatch.chdir(tmp_path)
    for name in ("IVYPLUG_PS_TIMEOUT", "IVYPLUG_PS_NUM_SERVERS", "IVYPLUG_PS_STALENESS_SCALING"):
        monkeypatch.delenv(name, raising=False)
    trainer = Trainer(strategy="ivy_ps", accelerator="cpu", devices=2, logger=False)
    cfg = trainer.strategy.ps_config
    assert (cfg.timeout, cfg.staleness_scaling, cfg.num_servers) == (300.0, "none", 0)
    assert IvyPSStrategy(timeout=5).ps_config.timeout == 5  # an argument beats the project file
    monkeypatch.setenv("IVYPLUG_PS_TIMEOUT", "42")
    assert IvyPSStrategy().ps_config.timeout == 42.0  # the environment beats the file
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nnum_servers = -1\n")
    with pytest.raises(ValueError, match=r"^IvyPSStrategy: num_servers must be an int >= 0, got -1 \(set by .*toml"):
        IvyPSStrategy()


def test_nonfinite_policy_from_argument_environment_and_pyproject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One option name everywhere: IvyPSStrategy(nonfinite=...), IVYPLUG_PS_NONFINITE, [tool.ivyplug.ps]."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("IVYPLUG_PS_NONFINITE", raising=False)
    assert IvyPSStrategy().ps_config.nonfinite == "skip"
    (tmp_path / "pyproject.toml").write_text('[tool.ivyplug.ps]\nnonfinite = "raise"\n')
    assert Trainer(strategy="ivy_ps_sync", accelerator="cpu", devices=2, logger=False).strategy.ps_config.nonfinite == (
        "raise"
    )
    monkeypatch.setenv("IVYPLUG_PS_NONFINITE", "skip")
    assert IvyPSStrategy().ps_config.nonfinite == "skip"  # the environment beats the file
    assert IvyPSStrategy(nonfinite="raise").ps_config.nonfinite == "raise"  # an argument beats both
    with pytest.raises(ValueError, match=r"^IvyPSStrategy: nonfinite must be one of \('skip', 'raise'\), got 'drop'$"):
        IvyPSStrategy(nonfinite="drop")
    with pytest.raises(ValueError, match=r"^IvyPSStrategy: servers='h:1' joins an ivyplug serve; num_servers=2"):
        IvyPSStrategy(servers="h:1", num_servers=2)  # a message that began "PSConfig: " names the strategy once
    monkeypatch.setenv("IVYPLUG_PS_TIMEOUT", "0")  # a project value refused: the caller and where it was set
    with pytest.raises(ValueError, match=r"^IvyPSStrategy: timeout must be .*, got 0.0 \(set by environment variable"):
        IvyPSStrategy()


def test_shared_memory_from_argument_environment_and_pyproject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """IvyPSStrategy(shared_memory=...), IVYPLUG_PS_SHARED_MEMORY, [tool.ivyplug.ps]; on by default."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("IVYPLUG_PS_SHARED_MEMORY", raising=False)
    assert IvyPSStrategy().ps_config.shared_memory is True
    (tmp_path / "pyproject.toml").write_text("[tool.ivyplug.ps]\nshared_memory = false\n")
    assert Trainer(strategy="ivy_ps", accelerator="cpu", devices=2, logger=False).strategy.ps_config.shared_memory is (
        False
    )
    monkeypatch.setenv("IVYPLUG_PS_SHARED_MEMORY", "true")
    assert IvyPSStrategy().ps_config.shared_memory is True  # the environment beats the file
    assert IvyPSStrategy(shared_memory=False).ps_config.shared_memory is False  # an argument beats both
    monkeypatch.setenv("IVYPLUG_PS_SHARED_MEMORY", "0")  # a switch's other spellings (1/0, yes/no, on/off)
    assert IvyPSStrategy().ps_config.shared_memory is False
    monkeypatch.setenv("IVYPLUG_PS_SHARED_MEMORY", "maybe")
    with pytest.raises(ValueError, match="IVYPLUG_PS_SHARED_MEMORY"):
        IvyPSStrategy()
