"""Package layout that pyproject.toml cannot express statically.

``integrations/`` and ``benchmarks/`` are shipped as ``ivyplug.integrations`` and
``ivyplug.benchmarks``; their subpackages are discovered here so adding one needs no edit.

The Lightning auto-registration ``.pth`` file (``integrations/lightning/autoregister.pth``)
is placed at the top of site-packages by both ``pip install .`` (custom ``build_py``) and
``pip install -e .`` (custom ``editable_wheel``): Python runs it at start-up, and it
registers ``strategy="ivy_ps"`` with Lightning only when Lightning's strategies are imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

MAPPED = {"integrations": "ivyplug.integrations", "benchmarks": "ivyplug.benchmarks"}

#: Source of the start-up hook and the name it gets in site-packages (sorts after
#: setuptools' ``__editable__.*.pth``, so the editable finder is active when it runs).
PTH_SOURCE = Path(__file__).parent / "integrations" / "lightning" / "autoregister.pth"
PTH_NAME = "ivyplug_lightning_autoregister.pth"

packages = find_packages(include=["ivyplug", "ivyplug.*"])
package_dir = {"ivyplug": "ivyplug"}
for folder, dotted in MAPPED.items():
    package_dir[dotted] = folder
    for sub in find_packages(include=[folder, f"{folder}.*"]):
        packages.append(dotted + sub[len(folder) :])


class BuildPyWithPth(build_py):
    """Also copy the start-up ``.pth`` to the root of the build (= site-packages once installed)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib, PTH_NAME)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(PTH_SOURCE), str(target), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(str(Path(self.build_lib, PTH_NAME)))
        return outputs


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: whatever it writes, the wheel also gets the ``.pth``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self._inner(wheel, files, mapping)
        wheel.writestr(PTH_NAME, PTH_SOURCE.read_bytes())

    def __enter__(self) -> _StrategyWithPth:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .`` ships the same start-up ``.pth`` as a regular install."""

    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
