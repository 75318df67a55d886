"""The README's Keras example (examples/readme_keras.py, quoted verbatim in the README), run as written
(TensorFlow backend, CPU, the default strategy): it must train the digits MLP to a good test accuracy, so
the learning rate it shows is one that works."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "readme_keras.py"


def test_readme_quotes_the_keras_example_verbatim() -> None:
    assert f"```python\n{EXAMPLE.read_text()}```" in (ROOT / "README.md").read_text()


@pytest.mark.timeout(120)
def test_readme_keras_example_reaches_good_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = runpy.run_path(str(EXAMPLE), run_name="readme_keras_example")  # as a reader runs it
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("test accuracy: ") and float(printed.split()[-1]) >= 0.95, printed
    assert type(namespace["model"].optimizer).__name__ == "LAMB"
