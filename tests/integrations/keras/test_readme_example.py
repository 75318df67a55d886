"""The README's Keras example, run as written (TensorFlow backend, CPU, the default strategy): it must train
the digits convnet to a good test accuracy, so the learning rate it shows is one that works."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

README = Path(__file__).resolve().parents[3] / "README.md"


def keras_example() -> str:
    """The first ``python`` block of the README's ``## Keras`` section."""
    text = README.read_text()
    section = text[text.index("\n## Keras\n") :]
    section = section[: section.index("\n## ", 1)]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's Keras section has no python block"
    return match.group(1)


def test_readme_keras_example_reaches_good_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    import keras

    code = keras_example()
    keras.utils.set_random_seed(0)  # reproducible weights and dropout; the balancer still reads real load
    namespace: dict[str, Any] = {"__name__": "readme_keras_example"}
    exec(compile(code, str(README), "exec"), namespace)  # no edits: as a reader would run it
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(printed) >= 0.95, printed
    model = namespace["model"]
    assert type(model.optimizer).__name__ == "LAMB"
    accuracy = model.evaluate(namespace["x_test"], namespace["y_test"], return_dict=True, verbose=0)["accuracy"]
    assert accuracy >= 0.95
