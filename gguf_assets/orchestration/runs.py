"""What `gguf-trainer runs --use` (and the studio's Use) tell the project's Dagster instance: the results it made
current again without a run (lib/runs/ does the files)."""

import uuid

import dagster as dg

from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.status.stages import TRAINING_STAGES, expected_fingerprints
from gguf_assets.orchestration.instance import prepare_instance
from gguf_assets.pipeline.private_api import (
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    INPUT_DATA_VERSION_TAG_PREFIX,
    INPUT_EVENT_POINTER_TAG_PREFIX,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from gguf_assets.pipeline.settings_observation import observe_settings, settings_key

# The stages whose results `gguf-trainer runs --use` can put back, in order: each is an input of the next.
MADE_CURRENT_STAGES = TRAINING_STAGES


def record_made_current(instance: dg.DagsterInstance, settings: Settings, paths: ProjectPaths, stages: list[str],
                        *, why: str) -> list[str]:
    """After `gguf-trainer runs --use` made a finished run's results current again without a run: observe the
    settings, then record a materialization of each of ``stages`` (adapter, gguf, eval_report) with the version its
    files have now and the provenance a run's materialization carries (the versions and events of its inputs), so
    the UI's stale marks agree with `status`. Returns the stages recorded: none that was never materialized in this
    instance (the UI then shows it missing, as before)."""
    observe_settings(instance, settings, paths)
    expected = expected_fingerprints(paths, settings)
    # The assets declare no code version; a run's id stands for it in theirs, this record's own id in this one.
    code_version, recorded = str(uuid.uuid4()), []
    for stage in (s for s in MADE_CURRENT_STAGES if s in stages and s in expected):
        key = dg.AssetKey(stage)
        previous = instance.get_latest_data_version_record(key)
        if previous is None:
            continue
        # The inputs this call does not change (the shards, the materials) are as the last run recorded them.
        tags = {k: v for k, v in (previous.event_log_entry.tags or {}).items()
                if k.startswith((f"{INPUT_DATA_VERSION_TAG_PREFIX}/", f"{INPUT_EVENT_POINTER_TAG_PREFIX}/"))}
        for parent, is_source in ((settings_key(stage), True), *((dg.AssetKey(s), False) for s in recorded)):
            if get_input_data_version_tag(parent) not in tags:
                continue  # not an input of this stage
            record = instance.get_latest_data_version_record(parent, is_source=is_source)
            if record is not None:
                tags[get_input_data_version_tag(parent)] = (record.event_log_entry.tags or {})[DATA_VERSION_TAG]
                tags[get_input_event_pointer_tag(parent)] = str(record.storage_id)
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=key, description=why, metadata={"made_current_by": dg.MetadataValue.text(why)},
            tags={**tags, DATA_VERSION_TAG: expected[stage], CODE_VERSION_TAG: code_version,
                  DATA_VERSION_IS_USER_PROVIDED_TAG: "true"}))
        recorded.append(stage)
    return recorded


def tell_dagster(paths: ProjectPaths, used, get_instance=None) -> str | None:
    """Record the results ``used`` (lib/runs/changes.Used) made current in the project's Dagster instance, so the
    UI's stale marks agree with `status`; a line saying what went wrong, or None. The files are the truth: a busy
    or unreachable instance only leaves the marks until the next run. ``get_instance``: the studio's (it has one
    open); the CLI opens the project's own, as `run` does."""
    if not used.stages:
        return None
    try:
        if get_instance is None:
            prepare_instance(paths)
            get_instance = dg.DagsterInstance.get
        record_made_current(get_instance(), used.settings, paths, used.stages,
                            why=f"gguf-trainer runs --use {used.run.name}")
    except Exception as exc:  # noqa: BLE001  the run's files are restored either way
        return (f"the Dagster UI was not told ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): it "
                f"shows {', '.join(used.stages)} stale until the next run")
    return None
