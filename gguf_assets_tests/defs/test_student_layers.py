"""materials.student_layer in a real project: ggk feeds the adapter the student's final-norm states and nothing
else, so a project that names another layer, or several (the removed layer-fusion feature), stops at load with its
project.yaml file:line and the reason, before any work; -1 and [-1] (old projects' forms) load."""

import re

import pytest
from conftest import cli

from gguf_assets.lib.project.layout import PROJECT_FILE
from gguf_assets.lib.project.settings import SettingsError, load_settings


def _set_student_layer(root, value: str) -> int:
    """Put ``student_layer: value`` in the project's materials section; return its 1-based line."""
    path = root / PROJECT_FILE
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("materials:")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^\S", lines[i])), len(lines))
    at = next((i for i in range(start + 1, end) if lines[i].startswith("  student_layer:")), None)
    if at is None:
        at = end
        lines.insert(at, "")
    lines[at] = f"  student_layer: {value}"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return at + 1


@pytest.mark.parametrize("value", ["5", "[1, -1]"])
def test_another_layer_or_several_are_refused_at_load_naming_the_line(make_project, value):
    paths = make_project()
    line = _set_student_layer(paths.root, value)
    with pytest.raises(SettingsError) as refused:
        load_settings(paths.root)
    message = str(refused.value)
    assert message.startswith(f"{paths.root / PROJECT_FILE}:{line}: materials.student_layer")
    assert "ggk feeds the adapter the student's final-norm hidden states (layer -1) and nothing else" in message
    assert "Set it to -1 or remove the key" in message
    # The command stops there too: exit 2, the same words, nothing made.
    done = cli("run", str(paths.root))
    assert done.returncode == 2, done.stderr
    assert f"{PROJECT_FILE}:{line}: materials.student_layer" in done.stderr and "final-norm" in done.stderr
    assert not (paths.root / "shards").exists() and not (paths.root / "checkpoints").exists()


@pytest.mark.parametrize("value", ["-1", "[-1]"])
def test_the_final_norm_loads_in_either_form(make_project, value):
    paths = make_project()
    _set_student_layer(paths.root, value)
    assert load_settings(paths.root).materials.student_layer == -1
