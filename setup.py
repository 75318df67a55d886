"""Package layout that pyproject.toml cannot express statically.

``integrations/`` and ``benchmarks/`` are shipped as ``ivyplug.integrations`` and
``ivyplug.benchmarks``; their subpackages are discovered here so adding one needs no edit.
"""

from __future__ import annotations

from setuptools import find_packages, setup

MAPPED = {"integrations": "ivyplug.integrations", "benchmarks": "ivyplug.benchmarks"}

packages = find_packages(include=["ivyplug", "ivyplug.*"])
package_dir = {"ivyplug": "ivyplug"}
for folder, dotted in MAPPED.items():
    package_dir[dotted] = folder
    for sub in find_packages(include=[folder, f"{folder}.*"]):
        packages.append(dotted + sub[len(folder) :])

setup(packages=packages, package_dir=package_dir)
