"""One `status` question reads each corpus split once (lib/status/states.py status_view): the stages, the
precompute's and training's pace and `estimate`'s time lines share one view's shard plans and adapter fingerprint
(on a copy of the suite's finished project, made part done)."""

import shutil
from collections import Counter

import pytest

from gguf_assets.lib.planning.time_estimate import time_lines
from gguf_assets.lib.precompute import shards_run
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.status.pace import pace_lines, precompute_pace
from gguf_assets.lib.status.stages import STAGES
from gguf_assets.lib.status.states import planned_view, project_status, status_view

ONCE_PER_SPLIT = Counter({"train": 1, "val": 1})


@pytest.fixture
def split_reads(monkeypatch) -> Counter:
    """How often each corpus split is read: every shard plan reads its split (lib/precompute/shards_run.py)."""
    reads: Counter = Counter()
    read_split = shards_run.read_split

    def counted(paths, split):
        reads[split] += 1
        return read_split(paths, split)

    monkeypatch.setattr(shards_run, "read_split", counted)
    return reads


def _status_question(paths, settings) -> list[str]:
    """What `gguf-trainer status` asks (cli.py _print_status): the stages, then the pace under them."""
    view = status_view(paths, settings)
    return pace_lines(paths, settings, view.stages, view=view)


@pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied
def test_one_status_question_plans_each_split_once(finished_project, tmp_path, split_reads):
    from conftest import copy_project

    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    # Shards left to make: the precompute's pace is shown, from the view's plans and half states.
    for folder in [*(paths.root / "shards/train").glob("0000[34]"), paths.root / "shards/val/00000"]:
        shutil.rmtree(folder)
    split_reads.clear()
    lines = _status_question(paths, settings)
    assert split_reads == ONCE_PER_SPLIT
    assert [line.split(":")[0] for line in lines] == ["precompute"]
    assert status_view(paths, settings).stages == project_status(paths, settings)

    split_reads.clear()
    assert time_lines(paths, settings)[0].endswith("(measured on this machine)")
    assert split_reads == ONCE_PER_SPLIT

    # The shard step's console line (defs/precompute.py): planned once, then only the half states are read again.
    planned = planned_view(paths, settings)
    shutil.rmtree(paths.root / "shards/train/00002")
    split_reads.clear()
    again = planned.rechecked(paths, settings)
    assert split_reads == Counter()
    assert precompute_pace(paths, settings, again) == precompute_pace(paths, settings) != precompute_pace(
        paths, settings, planned)


@pytest.mark.slow
def test_one_status_question_of_a_part_trained_adapter_plans_each_split_once(finished_project, tmp_path,
                                                                             split_reads):
    from conftest import copy_project

    from gguf_assets.lib.core import atomic
    from gguf_assets.lib.project.layout import SESSION_FILE
    from gguf_assets.lib.training.training_run import SESSION_RUNNING

    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    view = status_view(paths, settings)
    assert view.adapter_fp is not None
    # Training runs now (its session says so) and no adapter is recorded: the adapter is partial, training's pace shown.
    atomic.write_json(paths.checkpoints_dir(view.adapter_fp) / SESSION_FILE,
                      {"state": SESSION_RUNNING, "step": 12, "steps_per_s": 2.0})
    paths.adapter_manifest.unlink()
    split_reads.clear()
    assert _status_question(paths, settings) == ["training: 12/40 steps, 2.00 steps/s measured, ETA 14s"]
    assert split_reads == ONCE_PER_SPLIT


@pytest.mark.slow
def test_one_status_question_computes_each_fingerprint_once(finished_project, tmp_path, fingerprint_callers):
    """#67: status_view and the observation's expected fingerprints (pipeline/settings_observation.py) are one
    question: each stage's fingerprint is computed once (they computed the corpus's, the export's and the
    report's twice, once to check the stage and once to observe it)."""
    from conftest import copy_project

    from gguf_assets.lib.status.stages import expected_fingerprints

    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    callers = fingerprint_callers
    callers.clear()
    view = status_view(paths, settings)
    expected = expected_fingerprints(paths, settings, view)
    assert all(s.state == "current" for s in view.stages)
    per_stage = ("materials_fingerprint", "corpus_fingerprint", "training_fingerprint", "gguf_fingerprint",
                 "report_fingerprint")
    assert {name: callers[name] for name in per_stage} == dict.fromkeys(per_stage, 1), callers
    assert set(expected) == set(STAGES)
    # A question of its own (no view) gets the same fingerprints: the shared chain changed none.
    assert expected_fingerprints(paths, settings) == expected
