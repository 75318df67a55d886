"""Strategy names: ivyplug's registry, Lightning's StrategyRegistry, the start-up .pth hook, LightningCLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ivyplug.integrations.lightning import registration
from ivyplug.integrations.lightning.autoregister import DISABLE_ENV

REPO = Path(__file__).resolve().parents[3]


def _run(code: str, env_extra: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO.parent),  # not the repo: the installed package and its .pth are what is tested
    )


def test_importing_the_package_and_plugin_imports_no_framework() -> None:
    proc = _run(
        """
        import sys
        import ivyplug.integrations.lightning, ivyplug.integrations.lightning.plugin
        import ivyplug.integrations.lightning.registration, ivyplug.integrations.lightning.autoregister
        heavy = sorted(m for m in ("torch", "lightning", "pytorch_lightning", "tensorflow") if m in sys.modules)
        print("HEAVY", heavy)
        print("ALL", ivyplug.integrations.lightning.__all__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "IvyPSStrategy" in proc.stdout


def test_fresh_interpreter_resolves_ivy_ps_names() -> None:
    """No ivyplug import anywhere: the installed .pth registers the names when Lightning loads."""
    proc = _run(
        """
        import sys
        assert "torch" not in sys.modules and "lightning" not in sys.modules
        assert "ivyplug.integrations.lightning.ps_strategy" not in sys.modules
        from lightning.pytorch import Trainer
        for name in ("ivy_ps", "ivy_ps_sync", "ivy_ps_ssp"):
            t = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
            s = t.strategy
            print("RESOLVED", name, type(s).__module__, type(s).__name__, s.mode, s.ps_config.staleness)
        import pytorch_lightning  # the old package name: a clear error instead of "not found in registry"
        try:
            pytorch_lightning.Trainer(strategy="ivy_ps", accelerator="cpu", devices=2)
        except ValueError as exc:
            print("LEGACY", "from lightning.pytorch import Trainer" in str(exc))
        """
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESOLVED")]
    module = "ivyplug.integrations.lightning.ps_strategy IvyPSStrategy"
    assert lines == [
        f"RESOLVED ivy_ps {module} async None",
        f"RESOLVED ivy_ps_sync {module} sync None",
        f"RESOLVED ivy_ps_ssp {module} ssp {registration.DEFAULT_SSP_STALENESS}",
    ]
    assert "LEGACY True" in proc.stdout


def test_autoregistration_can_be_switched_off() -> None:
    """With the switch set, the start-up line imports nothing and installs no hook (so no names appear)."""
    code = """
        import sys
        print("HOOK", any(type(f).__name__ == "StrategyRegistryHook" for f in sys.meta_path))
        print("IMPORTED", "ivyplug.integrations.lightning.autoregister" in sys.modules)
        """
    on, off = _run(code), _run(code, env_extra={DISABLE_ENV: "1"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "HOOK True" in on.stdout and "IMPORTED True" in on.stdout
    assert "HOOK False" in off.stdout and "IMPORTED False" in off.stdout


def test_switched_off_the_names_come_from_register_with_lightning() -> None:
    """What the configuration reference tells a user who sets the switch: the name is unknown to the Trainer
    until ``register_with_lightning()`` is called."""
    code = """
        from lightning.pytorch import Trainer
        try:
            Trainer(strategy="ivy_ps", accelerator="cpu", devices=1, logger=False)
        except ValueError as exc:
            print("BEFORE refused", "ivy_ps" in str(exc))
        from ivyplug.integrations.lightning.registration import register_with_lightning
        print("REGISTERED", register_with_lightning())
        trainer = Trainer(strategy="ivy_ps", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        print("AFTER", type(trainer.strategy).__name__, trainer.strategy.mode)
        """
    proc = _run(code, env_extra={DISABLE_ENV: "1"})
    assert proc.returncode == 0, proc.stderr
    assert "BEFORE refused True" in proc.stdout, proc.stdout
    assert "REGISTERED ['ivy_ps', 'ivy_ps_sync', 'ivy_ps_ssp']" in proc.stdout
    assert "AFTER IvyPSStrategy async" in proc.stdout, proc.stdout


def test_register_strategies_is_idempotent_and_respects_foreign_names() -> None:
    from ivyplug.integrations.lightning import IvyPSStrategy
    from lightning.fabric.strategies.registry import _StrategyRegistry

    reg = _StrategyRegistry()
    IvyPSStrategy.register_strategies(reg)
    IvyPSStrategy.register_strategies(reg)  # again: replaces our own entries
    assert sorted(reg) == ["ivy_ps", "ivy_ps_ssp", "ivy_ps_sync"]
    strategy = reg.get("ivy_ps_ssp")
    assert isinstance(strategy, IvyPSStrategy)
    assert (strategy.mode, strategy.ps_config.staleness) == ("ssp", registration.DEFAULT_SSP_STALENESS)

    foreign = _StrategyRegistry()
    foreign.register("ivy_ps", dict, description="someone else's")
    with pytest.warns(RuntimeWarning, match="already registered by another package"):
        names = registration.register_strategies(foreign)
    assert names == ["ivy_ps_sync", "ivy_ps_ssp"]
    assert foreign["ivy_ps"]["strategy"] is dict


def test_ivyplug_registry_lists_and_builds_the_strategies() -> None:
    from ivyplug.registry import build_registry

    reg = build_registry(autoload=False, builtins=["ivyplug.integrations.lightning.plugin"])
    assert reg.names("strategy") == ["lightning.ivy_ps", "lightning.ivy_ps_ssp", "lightning.ivy_ps_sync"]
    strategy = reg.get("strategy", "ivy_ps_sync")()
    assert type(strategy).__name__ == "IvyPSStrategy"
    assert strategy.mode == "sync"


@pytest.mark.parametrize(
    "strategy_yaml, expected",
    [
        ("strategy: ivy_ps", ("async", None)),
        (
            """strategy:
    class_path: ivyplug.integrations.lightning.IvyPSStrategy
    init_args:
      mode: ssp
      staleness: 2
      timeout: 30.0""",
            ("ssp", 2),
        ),
    ],
)
def test_lightning_cli_yaml(tmp_path: Path, strategy_yaml: str, expected: tuple[str, int | None]) -> None:
    from ivyplug.integrations.lightning import IvyPSStrategy
    from lightning.pytorch.cli import LightningCLI

    from .digits import DigitsMLP

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  enable_progress_bar: false\n"
        + textwrap.indent(strategy_yaml, "  ")
        + "\n"
    )
    cli = LightningCLI(DigitsMLP, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, IvyPSStrategy)
    assert (strategy.mode, strategy.ps_config.staleness) == expected


def test_startup_line_is_silent_when_ivyplug_is_gone(tmp_path: Path) -> None:
    """A .pth left behind (or a broken environment) must not print a traceback at every interpreter start."""
    line = (REPO / "integrations" / "lightning" / "autoregister.pth").read_text().strip()
    code = f"import sys; sys.path[:] = [p for p in sys.path if p]; exec({line!r}); print('OK')"
    proc = subprocess.run(  # -S: no site-packages, so ivyplug cannot be found; run the line as site.py would
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k not in (DISABLE_ENV, "PYTHONPATH")},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr
    assert proc.stderr == ""
