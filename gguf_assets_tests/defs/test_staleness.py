"""After a settings change, exactly the dependent assets are stale in Dagster's own view (the UI's),
and exactly those are materialized by the next run.

The settings are observable source assets whose data versions hash every setting a stage's
result depends on, its inputs' included; the daemon's sensor observes them, so a change marks the
changed stage and everything that reads it without reloading the definitions.
"""

import shutil

import dagster as dg
import pytest
from conftest import copy_project, project_instance

from gguf_assets.definitions import build_definitions
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.status.states import project_status
from gguf_assets.orchestration.instance import instance_env
from gguf_assets.orchestration.launching import run_pipeline
from gguf_assets.pipeline.private_api import CachingStaleStatusResolver, LoadingContextForTest, StaleStatus
from gguf_assets.pipeline.resume import resume_decision
from gguf_assets.pipeline.settings_observation import STALE_BECAUSE, settings_key

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

ASSETS = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")


def _stale(paths) -> set[str]:
    """What the UI shows stale once the daemon's sensor has looked at project.yaml (no reload)."""
    defs = build_definitions(None)  # what a running webserver loaded once: it knows no settings
    instance = dg.DagsterInstance.get()
    resume_decision(instance)  # what the daemon runs every GGUF_ASSETS_SENSOR_INTERVAL_S
    # The same resolver the webserver uses to draw "stale" on the graph.
    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    stale = set()
    for name in ASSETS:
        key = dg.AssetKey(name)
        partitions = instance.get_dynamic_partitions(name) if name.endswith("_shards") else [None]
        if any(resolver.get_status(key, partition_key=p) == StaleStatus.STALE for p in partitions):
            stale.add(name)
    return stale


def _latest_observation_metadata(key: dg.AssetKey) -> dict:
    instance = dg.DagsterInstance.get()
    record = instance.fetch_observations(key, limit=1).records[0]
    return record.asset_observation.metadata


def _materialized_since(storage_id: int) -> set[str]:
    instance = dg.DagsterInstance.get()
    return {name for name in ASSETS if instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(name), after_storage_id=storage_id), limit=1).records}


def _last_storage_id() -> int:
    instance = dg.DagsterInstance.get()
    ids = [r.storage_id for name in ASSETS for r in instance.fetch_materializations(dg.AssetKey(name), limit=1).records]
    return max(ids, default=0)


DOWNSTREAM_OF_SHARDS = {"train_shards", "val_shards", "adapter", "gguf", "eval_report"}


def test_settings_changes_mark_exactly_the_dependent_assets_stale_and_only_those_rerun(make_project):
    """Each change, cumulative: the UI's stale set is exactly what the next run materializes."""
    # The real teacher (its layers are a setting), on few prompts: 2 train shards and 1 val shard.
    paths = make_project(steps=10, corpus={"train_prompts": 100, "val_prompts": 25},
                         precompute={"shard_size": 50, "val_shard_size": 25})
    shutil.copytree(paths.root / "materials/demo/teacher", paths.root / "materials/demo/teacher-copy")
    run_pipeline(paths, echo=lambda _: None)
    assert _stale(paths) == set()

    # (change, what the UI marks stale at once, what the next run redoes, the first stale stage and why).
    # The UI marks a stage once its fingerprint changes: a new teacher or corpus first marks the stage
    # that reads it; what comes after is marked once that stage is redone (`status` calls it blocked).
    changes = [
        ({"training": {"log_every": 7}}, set(), set(), None),  # cadence settings change nothing computed
        ({"precompute": {"student_dtype": "f32"}}, DOWNSTREAM_OF_SHARDS, DOWNSTREAM_OF_SHARDS,
         ("train_shards", "precompute.student_dtype bf16 → f32")),
        ({"materials": {"teacher_layer": 1}}, DOWNSTREAM_OF_SHARDS, DOWNSTREAM_OF_SHARDS,
         ("train_shards", "materials.teacher_layer -1 → 1")),
        ({"materials": {"teacher": "materials/demo/teacher-copy"}}, {"materials"}, {"materials"} | DOWNSTREAM_OF_SHARDS,
         ("materials", "materials.teacher materials/demo/teacher → materials/demo/teacher-copy")),
        ({"corpus": {"seed": 3}}, {"corpus"}, {"corpus"} | DOWNSTREAM_OF_SHARDS, ("corpus", "corpus.seed 0 → 3")),
        ({"output": {"ggk_command": "ggk --adapter {adapter_gguf}"}}, {"eval_report"}, {"eval_report"},
         ("eval_report", "output.ggk_command ")),
        ({"training": {"learning_rate": 5e-4}}, {"adapter", "gguf", "eval_report"}, {"adapter", "gguf", "eval_report"},
         ("adapter", "training.learning_rate 0.006 → 0.0005")),
    ]
    for change, stale_now, dependent, (stage, why) in ((c, n, d, w or (None, None)) for c, n, d, w in changes):
        before_edit = load_settings(paths.root)
        write_project_file(paths.root, replace(before_edit, **change))
        ui_stale = _stale(paths)
        assert ui_stale == stale_now, change
        status = {s.stage: s for s in project_status(paths, load_settings(paths.root))}
        # One engine: what status calls stale the UI marks, and the UI marks nothing status calls current.
        assert {s for s, st in status.items() if st.state == "stale"} <= ui_stale, (change, status)
        assert all(status[s].state != "current" for s in ui_stale), (change, status)
        if stage is not None:
            # The same words in `status` and on the stage's settings asset in the UI.
            assert status[stage].state == "stale" and why in status[stage].detail, (change, status[stage])
            observed = _latest_observation_metadata(settings_key(stage))
            assert why in observed[STALE_BECAUSE].value, (change, observed)
        else:
            assert all(s.state == "current" for s in status.values()), status
        teacher_files = {p: p.stat().st_mtime_ns for p in paths.root.glob("shards/*/*/teacher.safetensors")}
        new_student = "student_dtype" in change.get("precompute", {})
        if new_student:  # hashed only for the change that needs it
            student_digests = {p: atomic.sha256_file(p) for p in paths.root.glob("shards/*/*/student.safetensors")}
            gguf_digest = atomic.sha256_file(paths.root / "output" / "demo-adapter.gguf")
        corpus_mtime = paths.corpus_manifest.stat().st_mtime_ns
        before = _last_storage_id()
        run_pipeline(paths, echo=lambda _: None)
        # New materials are always followed by the corpus, which then only records that it is current.
        assert _materialized_since(before) == dependent | ({"corpus"} if "materials" in dependent else set()), change
        assert ("corpus" in dependent) == (paths.corpus_manifest.stat().st_mtime_ns != corpus_mtime), change
        assert _stale(paths) == set(), change
        if new_student:  # the teacher targets were reused, not redone
            assert {p: p.stat().st_mtime_ns for p in teacher_files} == teacher_files
            # while every student half and the GGUF are new
            assert all(atomic.sha256_file(p) != digest for p, digest in student_digests.items()), change
            assert atomic.sha256_file(paths.root / "output" / "demo-adapter.gguf") != gguf_digest, change

    # Redo only the adapter: what reads it stays stale, nothing upstream turns stale.
    write_project_file(paths.root, replace(load_settings(paths.root), training={"weight_decay": 0.02}))
    defs = build_definitions(str(paths.root))
    resources = {"project": ProjectResource(project_dir=str(paths.root))}
    assert dg.materialize(list(defs.assets), instance=dg.DagsterInstance.get(), resources=resources,
                          selection=["adapter"]).success
    assert _stale(paths) == {"gguf", "eval_report"}

    # A run that finds a result current records it with the same data version: nothing after it turns stale.
    write_project_file(paths.root, replace(load_settings(paths.root), training={"weight_decay": 0.01}))
    run_pipeline(paths, echo=lambda _: None)  # back to the finished training run: reused, then exported
    assert _stale(paths) == set()
    assert dg.materialize(list(defs.assets), instance=dg.DagsterInstance.get(), resources=resources,
                          selection=["adapter"]).success
    assert _stale(paths) == set()


def test_new_shard_size_re_registers_partitions_and_reruns(finished_project, tmp_path, monkeypatch):
    paths = copy_project(finished_project[0], tmp_path / "copy")
    for name, value in instance_env(paths).items():  # restored after the test
        monkeypatch.setenv(name, value)
    instance = project_instance(paths)
    assert len(instance.get_dynamic_partitions("train_shards")) == 4  # 400 prompts / 100

    settings = load_settings(paths.root)
    write_project_file(paths.root, replace(settings, precompute={"shard_size": 75}))
    status = run_pipeline(paths, echo=lambda _: None)
    assert all(s.state == "current" for s in status)
    assert list(instance.get_dynamic_partitions("train_shards")) == [f"{i:05d}" for i in range(6)]


def test_one_observation_and_plan_plans_each_split_once(finished_project, tmp_path, monkeypatch):
    """#58: observe_settings computed every stage's fingerprint (each split's shards planned), the whole status again
    when one had changed, and the plan asked for the status once more. One status question now serves all three."""
    from conftest import copy_project, project_instance

    from gguf_assets.lib.precompute import shards_run
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status import states
    from gguf_assets.lib.status.states import status_view
    from gguf_assets.pipeline.plan import next_work
    from gguf_assets.pipeline.settings_observation import observe_settings

    paths = copy_project(finished_project[0], tmp_path / "copy")
    settings = load_settings(paths.root)
    planned = []
    real = shards_run.plan_shards
    counting = lambda *a, **k: planned.append(a[3]) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(shards_run, "plan_shards", counting)
    monkeypatch.setattr(states, "plan_shards", counting)
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    instance = project_instance(paths)
    view = status_view(paths, settings)
    observe_settings(instance, settings, paths, view=view)
    assert next_work(paths, settings, instance, view) is None  # the finished project: nothing to do
    assert sorted(planned) == ["train", "val"], planned


def test_after_a_stage_only_the_later_stages_are_checked_again(finished_project, tmp_path, monkeypatch,
                                                                fingerprint_callers):
    """#67: after a stage wrote its result (ProjectResource.result_written), the observation computes only the
    fingerprints of the stages after it, and asks for their states only when one changed (it recomputed the
    whole status, materials and corpus checked again, after every asset)."""
    from gguf_assets.pipeline.settings_observation import observe_settings

    paths = copy_project(finished_project[0], tmp_path / "copy")
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    instance = project_instance(paths)
    callers = fingerprint_callers
    callers.clear()
    assert observe_settings(instance, load_settings(paths.root), paths, after="gguf") == []
    # The report's fingerprint chains the export's and the adapter's; the materials and corpus are not checked.
    assert (callers["report_fingerprint"], callers["gguf_fingerprint"]) == (1, 1), callers
    assert (callers["materials_fingerprint"], callers["corpus_fingerprint"]) == (0, 0), callers

    # A later stage whose fingerprint changed is observed, with why, from the status asked then.
    write_project_file(paths.root, replace(load_settings(paths.root),
                                           output={"ggk_command": "ggk --adapter {adapter_gguf}"}))
    callers.clear()
    assert observe_settings(instance, load_settings(paths.root), paths, after="gguf") == ["eval_report"]
    observed = instance.fetch_observations(settings_key("eval_report"), limit=1).records[0]
    assert "output.ggk_command " in observed.asset_observation.metadata[STALE_BECAUSE].value
    assert callers["report_fingerprint"] == 1, callers
