"""Package layout that pyproject.toml cannot express statically.

``integrations/`` and ``benchmarks/`` are shipped as ``ivyplug.integrations`` and
``ivyplug.benchmarks``; their subpackages are discovered here so adding one needs no edit.

The auto-registration ``.pth`` files (``integrations/lightning/autoregister.pth``,
``integrations/keras/autoregister.pth``) are placed at the top of site-packages by both
``pip install .`` (custom ``build_py``) and ``pip install -e .`` (custom ``editable_wheel``):
Python runs them at start-up; one registers ``strategy="ivy_ps"`` with Lightning only when
Lightning's strategies are imported, the other ``ivyplug>LAMB`` and ``ivyplug>AsyncLAMB`` with
Keras's serialization only when Keras is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

MAPPED = {"integrations": "ivyplug.integrations", "benchmarks": "ivyplug.benchmarks"}

#: Name in site-packages -> source of each start-up hook (the names sort after setuptools'
#: ``__editable__.*.pth``, so the editable finder is active when they run).
PTH_FILES = {
    "ivyplug_lightning_autoregister.pth": Path(__file__).parent / "integrations" / "lightning" / "autoregister.pth",
    "ivyplug_keras_autoregister.pth": Path(__file__).parent / "integrations" / "keras" / "autoregister.pth",
}

packages = find_packages(include=["ivyplug", "ivyplug.*"])
package_dir = {"ivyplug": "ivyplug"}
for folder, dotted in MAPPED.items():
    package_dir[dotted] = folder
    for sub in find_packages(include=[folder, f"{folder}.*"]):
        packages.append(dotted + sub[len(folder) :])


class BuildPyWithPth(build_py):
    """Also copy the start-up ``.pth`` files to the root of the build (= site-packages once installed)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            for name, source in PTH_FILES.items():
                target = Path(self.build_lib, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(source), str(target), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.extend(str(Path(self.build_lib, name)) for name in PTH_FILES)
        return outputs


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: whatever it writes, the wheel also gets the ``.pth`` files."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self._inner(wheel, files, mapping)
        for name, source in PTH_FILES.items():
            wheel.writestr(name, source.read_bytes())

    def __enter__(self) -> _StrategyWithPth:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .`` ships the same start-up ``.pth`` files as a regular install."""

    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
