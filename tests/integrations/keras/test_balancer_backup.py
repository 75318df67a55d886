"""The balancer's backup file beside ``BackupAndRestore``'s: what is kept, and files that cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("keras")

from ivyplug.integrations.keras import balancer_backup
from ivyplug.integrations.keras.balancer_backup import BalancerBackup


def _state(epochs_done: int) -> BalancerBackup:
    return BalancerBackup(
        epochs_done=epochs_done,
        core={"rule": epochs_done},
        position=100 * epochs_done,
        batch_now=16,
        scheduled=[(3, 32)],
        pending=[(3, 2.0)],
        learning_rate=0.01 * epochs_done,
    )


def _metadata(directory: Path, text: str) -> None:
    (directory / balancer_backup.KERAS_METADATA_FILE).write_text(text)


def test_the_last_two_epochs_and_those_keras_names_are_kept_and_read_back(tmp_path: Path) -> None:
    for epochs_done in range(1, 5):
        balancer_backup.save(tmp_path, _state(epochs_done), named=1 if epochs_done < 4 else None)
    kept = json.loads((tmp_path / balancer_backup.STATE_FILE).read_text())["states"]
    assert sorted(kept, key=int) == ["3", "4"]  # epoch 1 kept while named, dropped by the save naming none
    state = balancer_backup.state_at(tmp_path, 3)
    assert state is not None and balancer_backup.state_at(tmp_path, 1) is None
    assert state.position == 300 and state.learning_rate == pytest.approx(0.03)
    assert [tuple(s) for s in state.scheduled] == [(3, 32)]


@pytest.mark.parametrize("text", ["", '{"epoch": ', '{"other": 1}', '{"epoch": "x"}', "[1]"])
def test_unreadable_keras_metadata_is_warned_and_names_no_epoch(tmp_path: Path, text: str) -> None:
    """Keras writes its metadata in place: a reader can meet it empty or half-written (another worker writing it)."""
    _metadata(tmp_path, text)
    with pytest.warns(RuntimeWarning, match=r"training_metadata\.json could not be read"):
        assert balancer_backup.keras_epoch(tmp_path) is None
    with pytest.warns(RuntimeWarning, match="could not be read"):
        balancer_backup.save(tmp_path, _state(2), named=balancer_backup.keras_epoch(tmp_path))
    assert json.loads((tmp_path / balancer_backup.STATE_FILE).read_text())["states"].keys() == {"2"}


def test_a_file_not_ours_or_of_other_fields_is_ignored_with_a_warning(tmp_path: Path) -> None:
    assert balancer_backup.state_at(tmp_path, 1) is None  # no file: nothing saved, nothing to warn about
    (tmp_path / balancer_backup.STATE_FILE).write_text("not json")
    with pytest.warns(RuntimeWarning, match="not a balancer backup"):
        assert balancer_backup.state_at(tmp_path, 1) is None
    (tmp_path / balancer_backup.STATE_FILE).write_text(json.dumps({"version": 1, "states": {"1": {"epochs": 1}}}))
    with pytest.warns(RuntimeWarning, match="ignoring"):
        assert balancer_backup.state_at(tmp_path, 1) is None
