"""The README's Lightning example (examples/readme_lightning.py, quoted verbatim in the README), run as a
reader runs it: two popen-launched workers on the async parameter server reach a good validation accuracy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integrations.lightning.test_example import run_script

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "readme_lightning.py"


def test_readme_quotes_the_lightning_example_verbatim() -> None:
    assert f"```python\n{EXAMPLE.read_text()}```" in (ROOT / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_readme_lightning_example_reaches_good_accuracy(tmp_path: Path) -> None:
    returncode, out = run_script([str(EXAMPLE)], tmp_path, timeout=150)
    assert returncode == 0, out[-3000:]
    match = re.search(r"validation accuracy: ([0-9.]+)", out)
    assert match, out[-3000:]
    assert float(match.group(1)) >= 0.93, out[-3000:]
