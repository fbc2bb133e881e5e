"""The project's settings seen by Dagster, computed: settings/<stage>'s asset key, its metadata and the observation
of each stage's expected fingerprint as that asset's data version (defs/settings.py defines the assets).

Each one's data version is the fingerprint that stage's result has when made now, from the
current settings and the inputs on disk (lib/status/stages.py ``expected_fingerprints``: the
fingerprints `status` compares, one engine). Every stage's asset depends on its settings asset
and returns its own fingerprint as its data version, so after an edit of project.yaml Dagster's
staleness marks exactly the stages whose results the edit changes, with no "Reload definitions"
and no second copy of the pipeline's graph: the observation comes from the daemon's sensors, from
`gguf-trainer run`, and from every run before it starts. A stage whose inputs must be redone first
is marked once they are (`status` calls it blocked until then).
"""


import dagster as dg

from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.status.stages import STAGES, expected_fingerprints, new_chain, stage_keys
from gguf_assets.lib.status.states import UNFINISHED, ProjectView, status_view
from gguf_assets.pipeline.private_api import DATA_VERSION_TAG

KEY_PREFIX = "settings"  # settings/<stage>
# The metadata entry that says why the stage is stale after this observation (as `status` does).
STALE_BECAUSE = "stale_because"


def settings_key(stage: str) -> dg.AssetKey:
    return dg.AssetKey([KEY_PREFIX, stage])


def _value_of(settings: Settings, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(settings, section), name)


def settings_metadata(settings: Settings, stage: str, project_dir: str | None = None) -> dict:
    """The settings a stage's result is computed from, as a table, with the project folder and how to
    change them: on the stage asset's page and on settings/<stage>. project.yaml stays the one source."""
    # project.yaml's own names and values: what the user edits, not the fingerprint's internal layout.
    rows = [[f"`{key}`", f"`{_value_of(settings, key)}`"] for key in stage_keys(settings, stage)]
    metadata = {"settings": dg.MetadataValue.md(markdown_table(["setting (project.yaml)", "value"], rows)),
                "how_to_change": dg.MetadataValue.md(
                    "Edit `project.yaml` in the project folder, then `gguf-trainer run` (or Materialize here). Only "
                    "what depends on the changed settings is redone; the UI marks it stale within the sensor "
                    "interval.")}
    if project_dir:  # relative, as the project's files record paths: a copied project's UI never shows the original
        metadata["project_folder"] = dg.MetadataValue.path(".")
    return metadata


def observe_settings(instance: dg.DagsterInstance, settings: Settings, paths: ProjectPaths, *,
                     after: str | None = None, view: ProjectView | None = None) -> list[str]:
    """Record each stage's expected fingerprint as the data version of settings/<stage> where it changed;
    returns those stages. ``after`` a stage (whose result was just written): only the stages that come after it,
    the only ones whose fingerprints its result can change (each lookup is a query of the instance's storage).

    The versions are lib/status/stages.py's ``expected_fingerprints``, the very fingerprints `status` compares,
    so Dagster's stale marks follow from them. A stage whose inputs do not exist yet keeps its last
    version. An observation also says why its stage is stale (the keys that changed since its result was
    made, old → new): the same words `gguf-trainer status` prints. The fingerprints and the states come from one
    status question (``view``: the caller's, when it asked already), each computed once; the states are asked
    only when an observation is written (after a stage, mostly none: only the later fingerprints are computed).
    """
    later = STAGES[STAGES.index(after) + 1:] if after is not None else STAGES
    chain = new_chain(paths, settings) if view is None else None
    versions = expected_fingerprints(paths, settings, view, chain=chain, stages=later)
    changed = [stage for stage, version in versions.items() if _recorded_version(instance, stage) != version]
    # The states say why a stage is stale: asked only when an observation is written (the chain's answers reused).
    status = {s.stage: s for s in (view or status_view(paths, settings, chain)).stages} if changed else {}
    for stage in changed:
        metadata = settings_metadata(settings, stage)
        if status[stage].state in UNFINISHED and status[stage].detail:
            metadata[STALE_BECAUSE] = dg.MetadataValue.text(status[stage].detail)
        instance.report_runless_asset_event(dg.AssetObservation(
            asset_key=settings_key(stage), tags={DATA_VERSION_TAG: versions[stage]}, metadata=metadata))
    return changed


def _recorded_version(instance: dg.DagsterInstance, stage: str) -> str | None:
    """The data version last observed for settings/<stage>, or None."""
    record = instance.get_latest_data_version_record(settings_key(stage), is_source=True)
    return (record.event_log_entry.tags or {}).get(DATA_VERSION_TAG) if record else None
