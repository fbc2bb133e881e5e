"""After a settings change, exactly the dependent assets are stale in Dagster's own view (the UI's).

Dagster marks an asset stale for its own causes (a new code version, i.e. changed settings,
or a new upstream data version); downstream assets turn stale once the upstream is redone.
"""

import dagster as dg
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from gguf_assets.definitions import build_definitions
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.settings import load_settings, replace, write_project_file
from gguf_assets.runner import run_pipeline

ASSETS = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")


def _stale(paths) -> set[str]:
    defs = build_definitions(str(paths.root))
    instance = dg.DagsterInstance.get()
    # The same resolver the webserver uses to draw "stale" on the graph.
    resolver = CachingStaleStatusResolver(instance, defs.resolve_asset_graph(), LoadingContextForTest(instance))
    stale = set()
    for name in ASSETS:
        key = dg.AssetKey(name)
        partitions = instance.get_dynamic_partitions(name) if name.endswith("_shards") else [None]
        if any(resolver.get_status(key, partition_key=p) == StaleStatus.STALE for p in partitions):
            stale.add(name)
    return stale


def test_settings_changes_mark_exactly_the_dependent_assets_stale(make_project):
    paths = make_project(steps=10, mock_teacher=True)
    run_pipeline(paths, echo=lambda _: None)
    assert _stale(paths) == set()

    settings = load_settings(paths.root)
    # Cadence settings change nothing that was computed.
    write_project_file(paths.root, replace(settings, training={"log_every": 7}))
    assert _stale(paths) == set()
    write_project_file(paths.root, replace(settings, materials={"student_layer": 1}))
    assert _stale(paths) == {"train_shards", "val_shards"}
    write_project_file(paths.root, replace(settings, corpus={"seed": 3}))
    assert _stale(paths) == {"corpus"}
    write_project_file(paths.root, replace(settings, output={"ggk_command": "ggk --adapter {adapter_gguf}"}))
    assert _stale(paths) == {"eval_report"}

    write_project_file(paths.root, replace(settings, training={"learning_rate": 5e-4}))
    assert _stale(paths) == {"adapter"}
    # Redo only the adapter: what reads it turns stale, nothing upstream does.
    defs = build_definitions(str(paths.root))
    resources = {"project": ProjectResource(project_dir=str(paths.root))}
    assert dg.materialize(list(defs.assets), instance=dg.DagsterInstance.get(), resources=resources,
                          selection=["adapter"]).success
    assert _stale(paths) == {"gguf"}

    # Rematerializing under the new settings makes everything fresh again.
    run_pipeline(paths, echo=lambda _: None)
    assert _stale(paths) == set()


def test_new_shard_size_re_registers_partitions_and_reruns(make_project):
    paths = make_project(steps=5, mock_teacher=True)
    run_pipeline(paths, echo=lambda _: None)
    instance = dg.DagsterInstance.get()
    assert len(instance.get_dynamic_partitions("train_shards")) == 4  # 1600 prompts / 400

    settings = load_settings(paths.root)
    write_project_file(paths.root, replace(settings, precompute={"shard_size": 300}))
    status = run_pipeline(paths, echo=lambda _: None)
    assert all(s.state == "current" for s in status)
    assert list(instance.get_dynamic_partitions("train_shards")) == [f"{i:05d}" for i in range(6)]
