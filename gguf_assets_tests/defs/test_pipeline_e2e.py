"""The whole DAG through real Dagster materializations: what the README's demo (conftest's ``demo_run``, the
suite's one full-size real-teacher pipeline) recorded in its project's own Dagster instance, and that a second run
has nothing to do."""

import dagster as dg
import pytest
from conftest import cli_env, copy_project, project_instance
from warm_runs import trainer_run

from gguf_assets.lib.core import atomic, metrics
from gguf_assets.lib.project.layout import REPORT_JSON, ProjectPaths
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.training.verdict import GOOD

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

ASSETS = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")


@pytest.mark.xdist_group("demo")  # on the worker that ran the demo
def test_the_demo_dag_is_recorded_stage_by_stage_in_the_project_s_dagster(demo_run, monkeypatch):
    """Every asset, shard partition, check and observation of the demo's pipeline, as the UI reads them."""
    project, done = demo_run
    assert done.returncode == 0, done.stdout + done.stderr
    paths = ProjectPaths.of(project)
    settings = load_settings(paths.root)
    report = atomic.read_json(paths.output_dir(settings) / REPORT_JSON)
    for key in ("val_centred_cosine", "empty_prompt_cosine", "gguf_path", "gguf_sha256", "val_centred_cosine_torch"):
        assert report[key] is not None, key
    assert report["gguf_path"] == "output/demo-adapter.gguf"  # relative: the project folder is portable
    assert atomic.sha256_file(paths.located(report["gguf_path"])) == report["gguf_sha256"]
    # The numpy reading of the GGUF agrees with the torch checkpoint, in its score and output by output.
    assert abs(report["val_centred_cosine"] - report["val_centred_cosine_torch"]) < 1e-3
    assert report[metrics.GGUF_VS_CHECKPOINT][metrics.MIN_ROW_COSINE] > 0.999
    # The scores beside the verdict (raw target space): a trained adapter's relative MSE is below the centre's 1.
    assert 0 < report[metrics.VAL_REL_MSE] < 1 and report[metrics.VAL_RMS_COSINE] > report[metrics.VAL_CENTRED_COSINE]
    assert report[metrics.WORST_ROW_COSINE] <= report[metrics.VAL_CENTRED_COSINE]
    # It listens to the prompt: nearly every val prompt's prediction is nearest its own target (0.990 of 198 at the
    # demo's seed; chance is 1/198), and the empty (CFG) prompts are left out.
    assert report[metrics.VAL_RETRIEVAL_TOP1] >= 0.9 and report[metrics.VAL_RETRIEVAL_TOP5] >= 0.95
    assert report[metrics.VAL_RETRIEVAL_MARGIN] > 0.5
    assert 0 < report[metrics.VAL_RETRIEVAL_PROMPTS] < report["n_prompts"]
    assert report["verdict"].startswith("Good") and "prompt retrieval top-1" in report["verdict"]
    run_dir = atomic.read_json(paths.adapter_manifest)["run_dir"]
    adapter_meta = atomic.read_json(paths.root / run_dir / "final" / "meta.json")
    untrained = adapter_meta["untrained_val_centred_cosine"]
    assert report["val_centred_cosine"] > untrained + 0.15, (report["val_centred_cosine"], untrained)
    assert (paths.output_dir(settings) / "report.md").read_text().count("Use it in ggk") == 1

    # Every asset and every shard partition is recorded in the project's own Dagster instance.
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))  # restored after the test
    instance = project_instance(paths)
    assert str(paths.dagster_home) in str(instance.root_directory)
    for name in ASSETS:
        assert instance.get_latest_materialization_event(dg.AssetKey(name)) is not None, name
    for split, n in (("train", 4), ("val", 1)):
        keys = instance.get_dynamic_partitions(f"{split}_shards")
        assert len(keys) == n
        materialized = instance.get_materialized_partitions(dg.AssetKey(f"{split}_shards"))
        assert set(keys) <= materialized
        # One materialization per shard per run, with that shard's own figures (not the run's totals).
        for key in keys:
            records = instance.fetch_materializations(dg.AssetRecordsFilter(
                asset_key=dg.AssetKey(f"{split}_shards"), asset_partitions=[key]), limit=10).records
            assert len(records) == 1, (split, key, len(records))
            meta = records[0].asset_materialization.metadata
            shard_size = settings.precompute.shard_size if split == "train" else settings.precompute.val_shard_size
            assert meta["prompts"].value == shard_size, (split, key)
            assert meta["teacher_tokens"].value > 0 and meta["prompts_per_s"].value > 0
            assert "teacher_device_map" in meta
    # Each stage's page shows the settings it depends on, the project folder and how to change them.
    for name in ASSETS:
        meta = instance.get_latest_materialization_event(dg.AssetKey(name)).asset_materialization.metadata
        # Relative, as the project's files: a copied project's UI shows no absolute path of the original.
        assert meta["project_folder"].value == "." and "project.yaml" in meta["how_to_change"].value
        if "report_json" in meta:
            assert not meta["report_json"].value.startswith("/"), meta["report_json"].value
    adapter_settings = instance.get_latest_materialization_event(
        dg.AssetKey("adapter")).asset_materialization.metadata["settings"].value
    assert f"| `training.width` | `{settings.training.width}` |" in adapter_settings
    # Progress and live hardware during the precompute arrive as observations of the shards: the run's progress
    # (done and total count the run's prompts) on the asset, each finished shard's own figures on its partition.
    observed = [r.asset_observation for r in instance.fetch_observations(dg.AssetKey("train_shards"),
                                                                          limit=1000).records]
    live = [o for o in observed if "half" in o.metadata]
    assert any("prompts_per_s" in o.metadata and "host_cpu_pct" in o.metadata for o in live), observed[:3]
    assert all(o.partition is None and o.metadata["total"].value == settings.corpus.train_prompts for o in live)
    finished = [o for o in observed if "half" not in o.metadata]
    assert sorted(o.partition for o in finished) == sorted(instance.get_dynamic_partitions("train_shards"))
    assert all(o.metadata["prompts"].value == settings.precompute.shard_size for o in finished)

    # Runs carry readable job names, and the asset checks beside the assets ran and passed.
    assert {r.dagster_run.job_name for r in instance.get_run_records()} == {
        "materials_and_corpus", "precompute_train_shards", "precompute_val_shards", "train_export_evaluate"}
    checks = {(e.asset_key.to_user_string(), e.check_name): e for e in (
        r.event_log_entry.dagster_event.event_specific_data for r in instance.get_records_for_run(
            instance.get_run_records()[0].dagster_run.run_id,
            of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records)}
    assert checks[("eval_report", "gguf_agrees_with_torch")].passed
    assert checks[("gguf", "exported_files_unchanged")].passed
    assert checks[("eval_report", "reported_files_unchanged")].passed
    # The eval_report's metadata carries every score, as numbers the UI plots over materializations.
    evaluated = instance.get_latest_materialization_event(dg.AssetKey("eval_report")).asset_materialization.metadata
    for key in (metrics.VAL_REL_MSE, metrics.VAL_RMS_COSINE, metrics.WORST_ROW_COSINE, metrics.EMPTY_PROMPT_COSINE,
                metrics.VAL_RETRIEVAL_TOP1, metrics.VAL_RETRIEVAL_TOP5, metrics.VAL_RETRIEVAL_MARGIN,
                *(f"{metrics.GGUF_VS_CHECKPOINT}_{k}" for k in metrics.AGREEMENT_KEYS)):
        assert isinstance(evaluated[key], dg.FloatMetadataValue), key
    assert evaluated[metrics.VAL_RETRIEVAL_PROMPTS].value == report[metrics.VAL_RETRIEVAL_PROMPTS]
    assert "prompt retrieval top-1" in evaluated["evaluation"].value
    retrieval = checks[("eval_report", "prompt_retrieval_above_chance")]
    assert retrieval.passed and retrieval.severity == dg.AssetCheckSeverity.WARN
    # Five significant digits, as the UI shows them (it prints a float's whole repr); the report keeps them all.
    assert evaluated[metrics.VAL_REL_MSE].value == metrics.shown(report[metrics.VAL_REL_MSE])
    floats = [value.value for value in evaluated.values() if isinstance(value, dg.FloatMetadataValue)]
    assert len(floats) > 10 and all(value == metrics.shown(value) for value in floats), floats
    assert report["ggk_command"] in evaluated["ggk_command"].value  # whole, in a code block
    assert evaluated[metrics.WORST_ROW].value == report[metrics.WORST_ROW]
    assert f"row {report[metrics.WORST_ROW]}: " in evaluated["evaluation"].value
    threshold = checks[("eval_report", "val_centred_cosine_threshold")]
    assert threshold.passed == (report["val_centred_cosine"] >= GOOD)  # the demo passes it
    assert threshold.severity == dg.AssetCheckSeverity.WARN  # a warning: a short run may stay below it
    shard_checks = [r.event_log_entry.dagster_event.event_specific_data for run in instance.get_run_records()
                    if run.dagster_run.job_name.startswith("precompute_") for r in instance.get_records_for_run(
                        run.dagster_run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records]
    assert len(shard_checks) == 2 and all(c.passed and c.check_name == "shards_verified" for c in shard_checks)

    # Training metrics and live hardware figures arrive as observations while it runs (the UI plots them).
    observations = instance.fetch_observations(dg.AssetKey("adapter"), limit=1000).records
    logged = [r.asset_observation.metadata for r in observations]
    assert any("loss" in m and "host_ram_used_gib" in m for m in logged)
    assert any("val_centred_cosine" in m for m in logged)
    assert any(metrics.VAL_REL_MSE in m and metrics.WORST_ROW_COSINE in m for m in logged)


@pytest.mark.xdist_group("demo")
def test_a_second_run_of_the_finished_demo_launches_nothing(demo_run, tmp_path, monkeypatch):
    project, done = demo_run
    assert done.returncode == 0, done.stdout + done.stderr
    paths = copy_project(project, tmp_path / "again")
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    runs_before = len(project_instance(paths).get_run_records())
    again = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(project_instance(paths).get_run_records()) == runs_before, again.stdout
    assert "val centred cosine:" in again.stdout  # the result is still shown


def test_mock_teacher_smoke_learns(finished_project):
    """The suite's reference run (a mock teacher, 40 steps) learns: read, not changed."""
    paths = ProjectPaths.of(finished_project[0])
    settings = load_settings(paths.root)
    report = atomic.read_json(paths.output_dir(settings) / REPORT_JSON)
    meta = atomic.read_json(paths.root / atomic.read_json(paths.adapter_manifest)["run_dir"] / "final" / "meta.json")
    assert meta["shape"]["target_dim"] == 64 and meta["shape"]["query_rows"] == 256
    # 40 steps of batch 8 with one head of ggk's 64: about +0.12 (the 4-head adapter before #55 made +0.3).
    assert report["val_centred_cosine"] > meta["untrained_val_centred_cosine"] + 0.08
