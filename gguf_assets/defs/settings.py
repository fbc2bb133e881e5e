"""The project's settings as Dagster assets: one observable source asset per stage, settings/<stage>, whose data
version is that stage's expected fingerprint (pipeline/settings_observation.py computes and records it)."""

import dagster as dg

from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.status.stages import STAGES, expected_fingerprints
from gguf_assets.pipeline import groups
from gguf_assets.pipeline.settings_observation import settings_key, settings_metadata


def _settings_asset(stage: str) -> dg.SourceAsset:
    @dg.observable_source_asset(key=settings_key(stage), group_name=groups.SETTINGS,
                                description=f"The project.yaml settings the {stage} stage is computed from. "
                                            "Edit project.yaml to change them.")
    def observe(context) -> dg.ObserveResult:
        from gguf_assets.lib.project.settings import SettingsError, load_settings
        from gguf_assets.pipeline.environment import project_dir_from_env

        folder = project_dir_from_env()
        try:
            settings = load_settings(folder)
        except SettingsError as exc:  # one clear message in the UI, not a stack trace
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        version = expected_fingerprints(ProjectPaths.of(folder), settings).get(stage)
        if version is None:
            raise dg.Failure(description=f"{stage} cannot be fingerprinted yet: what it is computed from does not "
                             "exist (materialize the stages before it first).", allow_retries=False)
        return dg.ObserveResult(data_version=dg.DataVersion(version),
                                metadata=settings_metadata(settings, stage, str(folder)))

    return observe


SETTINGS_ASSETS = [_settings_asset(stage) for stage in STAGES]
