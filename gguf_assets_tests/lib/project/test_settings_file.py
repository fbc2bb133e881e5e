"""save_if_unchanged: an editor's save that lands at the very instant of the studio's rename is not lost."""

from pathlib import Path

import pytest

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project import settings_file
from gguf_assets.lib.project.settings_file import SettingsChanged, save_if_unchanged, text_sha256


@pytest.mark.parametrize("editor_text", ["seed: 7\nsteps: 40\n", "seed: 0\nsteps: 40\n"])
def test_an_editor_save_between_the_last_look_and_the_rename_is_swapped_back(tmp_path: Path, monkeypatch,
                                                                             editor_text):
    """Also when the editor saved the very same text: its file is back in place, and the save says it was not
    written (it must not report a save whose text is gone)."""
    project_file = tmp_path / "project.yaml"
    project_file.write_text("seed: 0\nsteps: 40\n")
    base = text_sha256(project_file.read_text())
    real_exchange = atomic.exchange

    def editor_saves_first(first: Path, second: Path) -> bool:
        atomic.write_text(project_file, editor_text)  # after every look, right before the swap
        monkeypatch.setattr(settings_file.atomic, "exchange", real_exchange)
        return real_exchange(first, second)

    monkeypatch.setattr(settings_file.atomic, "exchange", editor_saves_first)
    with pytest.raises(SettingsChanged) as refused:
        save_if_unchanged(project_file, tmp_path / ".dagster", "seed: 0\nsteps: 41\n", base)
    assert project_file.read_text() == editor_text  # the editor's file, kept
    assert refused.value.current.text == editor_text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(atomic.TEMP_PREFIX)] == []


def test_a_save_on_the_unchanged_file_swaps_in_and_leaves_no_temp_file(tmp_path: Path):
    project_file = tmp_path / "project.yaml"
    project_file.write_text("seed: 0\n")
    saved = save_if_unchanged(project_file, tmp_path / ".dagster", "seed: 1\n", text_sha256("seed: 0\n"))
    assert project_file.read_text() == "seed: 1\n" and saved.sha256 == text_sha256("seed: 1\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(atomic.TEMP_PREFIX)] == []


def test_exchange_swaps_two_files(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("A")
    b.write_text("B")
    if not atomic.exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (a.read_text(), b.read_text()) == ("B", "A")
