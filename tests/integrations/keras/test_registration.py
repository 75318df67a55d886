"""``ivyplug>LAMB`` / ``ivyplug>AsyncLAMB`` by name: after ``import ivyplug.integrations.keras``, and through
the start-up ``.pth`` hook in a program that imports only Keras (fresh interpreters, as a user's would be)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from ivyplug.integrations.keras import autoregister
from ivyplug.integrations.keras.autoregister import DISABLE_ENV

keras = pytest.importorskip("keras")

REPO = Path(__file__).resolve().parents[3]
PTH_SOURCE = REPO / "integrations" / "keras" / "autoregister.pth"
PTH_NAME = "ivyplug_keras_autoregister.pth"


def _script(*parts: str) -> str:
    """Python source from indented pieces (each dedented on its own)."""
    return "\n".join(textwrap.dedent(part) for part in parts)


def _run(code: str, *, switch_off: bool = False, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    if switch_off:
        env[DISABLE_ENV] = "1"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO.parent),  # not the repo: the installed package and its .pth are what is tested
    )


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ``.keras`` file per optimizer, each after two training steps (so optimizer state is saved too)."""
    from ivyplug.integrations.keras import LAMB, AsyncLAMB

    folder = tmp_path_factory.mktemp("saved")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = x[:, :2] * 2.0
    paths = {}
    for cls in (LAMB, AsyncLAMB):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=cls(learning_rate=1e-2, exclude_from_layer_adaptation=["bias"]), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        paths[cls.__name__] = folder / f"{cls.__name__}.keras"
        model.save(paths[cls.__name__])
    return paths


def _load_and_print(paths: dict[str, Path]) -> str:
    return f"""
        for path in {[str(p) for p in paths.values()]!r}:
            opt = keras.models.load_model(path).optimizer
            cfg = opt.get_config()
            lr, patterns = round(cfg["learning_rate"], 6), cfg["exclude_from_layer_adaptation"]
            print("LOADED", type(opt).__module__, type(opt).__name__, int(opt.iterations), lr, patterns)
        """


EXPECTED_LOADED = [
    "LOADED ivyplug.integrations.keras.lamb LAMB 2 0.01 ['bias']",
    "LOADED ivyplug.integrations.keras.async_lamb AsyncLAMB 2 0.01 ['bias']",
]


def _loaded(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("LOADED")]


FIRST_IMPORTS = {
    "package-then-keras": "import ivyplug.integrations.keras\nimport keras",
    "keras-then-package": "import keras\nimport ivyplug.integrations.keras",
    # Keras first imported by lamb.py / async_lamb.py themselves, before their class exists
    "LAMB-before-keras": "from ivyplug.integrations.keras import LAMB\nimport keras",
    "AsyncLAMB-module-before-keras": "from ivyplug.integrations.keras.async_lamb import AsyncLAMB\nimport keras",
}


@pytest.mark.parametrize("imports", list(FIRST_IMPORTS.values()), ids=list(FIRST_IMPORTS))
def test_package_import_registers_for_compile_and_load(saved_models: dict[str, Path], imports: str) -> None:
    """The start-up hook is off: ``import ivyplug.integrations.keras`` alone must make the names resolve."""
    code = _script(
        imports,
        """
        for name in ("ivyplug>LAMB", "ivyplug>AsyncLAMB"):
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer={"class_name": name, "config": {"learning_rate": 1e-2}}, loss="mse")
            print("COMPILED", name, type(model.optimizer).__name__, round(float(model.optimizer.learning_rate), 6))
        """,
        _load_and_print(saved_models),
    )
    proc = _run(code, switch_off=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("COMPILED")]
    assert compiled == ["COMPILED ivyplug>LAMB LAMB 0.01", "COMPILED ivyplug>AsyncLAMB AsyncLAMB 0.01"]
    assert _loaded(proc.stdout) == EXPECTED_LOADED
    assert "could not register" not in proc.stderr


def test_startup_hook_loads_a_saved_model_in_a_program_that_imports_only_keras(
    saved_models: dict[str, Path],
) -> None:
    code = _script(
        """
        import sys
        assert not any(m.startswith("ivyplug.integrations.keras.") for m in sys.modules if "autoregister" not in m)
        import keras
        print("TORCH_AFTER_KERAS", "torch" in sys.modules)
        """,
        _load_and_print(saved_models),
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _loaded(proc.stdout) == EXPECTED_LOADED
    assert "TORCH_AFTER_KERAS False" in proc.stdout  # registering does not pull in torch
    assert "Traceback" not in proc.stderr and "ivyplug" not in proc.stderr


def test_startup_hook_switched_off_leaves_keras_alone(saved_models: dict[str, Path]) -> None:
    code = _script(f"""
        import sys
        print("HOOK", any(type(f).__name__ == "KerasImportHook" for f in sys.meta_path))
        import keras
        try:
            keras.models.load_model({str(saved_models["LAMB"])!r})
        except Exception as exc:
            print("FAILED", type(exc).__name__, str(exc).splitlines()[0])
        """)
    proc = _run(code, switch_off=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HOOK False" in proc.stdout
    assert "FAILED" in proc.stdout and "LAMB" in proc.stdout, proc.stdout


def test_startup_line_installs_only_a_finder_and_honours_the_switch() -> None:
    """At start-up: no Keras, no TensorFlow, no torch, only the finder; with the switch, not even that."""
    code = _script("""
        import sys
        print("HOOK", any(type(f).__name__ == "KerasImportHook" for f in sys.meta_path))
        print("IMPORTED", "ivyplug.integrations.keras.autoregister" in sys.modules)
        print("HEAVY", sorted(m for m in ("keras", "tensorflow", "torch", "numpy") if m in sys.modules))
        """)
    on, off = _run(code), _run(code, switch_off=True)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "HOOK True" in on.stdout and "IMPORTED True" in on.stdout and "HEAVY []" in on.stdout
    assert "HOOK False" in off.stdout and "IMPORTED False" in off.stdout


def test_the_pth_is_installed_into_site_packages() -> None:
    """``pip install (-e) .`` ships the start-up line; a stale copy means the install needs re-running."""
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    installed = [Path(f, PTH_NAME) for f in folders if Path(f, PTH_NAME).is_file()]
    assert installed, f"{PTH_NAME} is in none of {folders}: run `pip install -e .` again"
    assert installed[0].read_text() == PTH_SOURCE.read_text()


def test_startup_line_is_silent_when_ivyplug_is_gone(tmp_path: Path) -> None:
    """A .pth left behind (or a broken environment) must not print a traceback at every interpreter start."""
    line = PTH_SOURCE.read_text().strip()
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


def test_a_failing_registration_warns_instead_of_breaking_keras(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> list[str]:
        raise ImportError("simulated")

    monkeypatch.setattr(autoregister, "register_serializables", broken)
    with pytest.warns(RuntimeWarning, match="could not register its Keras classes"):
        autoregister._register()


def test_register_serializables_is_idempotent() -> None:
    from ivyplug.integrations.keras import LAMB, AsyncLAMB

    assert autoregister.register_serializables() == list(autoregister.REGISTERED_NAMES)
    assert autoregister.register_serializables() == list(autoregister.REGISTERED_NAMES)
    assert keras.saving.get_registered_object("ivyplug>LAMB") is LAMB
    assert keras.saving.get_registered_object("ivyplug>AsyncLAMB") is AsyncLAMB
    assert keras.saving.get_registered_name(LAMB) == "ivyplug>LAMB"
