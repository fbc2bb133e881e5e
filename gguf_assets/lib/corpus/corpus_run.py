"""What a corpus build is: the settings its result depends on, its fingerprint and whether the corpus on disk
is current. No numpy or torch here: `status` and the planner read it (lib/status/), and so does the corpus
asset before it builds.

The fingerprint covers the corpus settings, every dataset's pin (source, commit, text field) and each local
prompt file's sha256 (read again only when its stamp changed since the last build read it).
"""

from __future__ import annotations

from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials.materials_run import chain_materials
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.manifests import CorpusManifest, DamagedRecord, MaterialsManifest, read_record
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Stage


def corpus_settings(settings: Settings) -> dict:
    """The corpus settings its fingerprint holds (the datasets enter it through their pins)."""
    return {"corpus": settings.section_dict("corpus")}


def corpus_stage_settings(settings: Settings) -> dict:
    """What the corpus's result is computed from, as settings/corpus shows it: its settings and the datasets
    it reads (a new dataset source marks the corpus, whose fingerprint sees it as a pin)."""
    return {**corpus_settings(settings), "datasets": settings.materials.datasets}


def _recorded_source_hashes(paths: ProjectPaths) -> dict[Path, dict]:
    """The prompt files the last corpus build read: their sha256 and their stamp then."""
    try:
        sources = (read_record(paths.corpus_manifest) or {}).get("sources", [])
    except (OSError, DamagedRecord):
        return {}
    return {paths.located(s["file"]): {**s.get("stamp", {}), "sha256": s.get("sha256")} for s in sources}


def corpus_fingerprint(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> str:
    local, recorded = [], _recorded_source_hashes(paths)
    for value in settings.corpus.local_prompt_files:
        file = paths.resolve_local(value)
        # A file read by the last build, with the same size, mtime and inode, is not read again.
        known = recorded.get(file)
        unchanged = known is not None and verify.stamp_matches(file, known) is True
        local.append([value, known["sha256"] if unchanged else atomic.sha256_file(file) if file.is_file() else None])
    datasets = [[d["source"], d["commit"], d.get("text_field")] for d in materials.datasets]
    return atomic.fingerprint({**corpus_settings(settings), "datasets": datasets, "local": local,
                               "format": formats.CORPUS})


def corpus_manifest(paths: ProjectPaths) -> CorpusManifest:
    """The corpus manifest; a clear error when there is none or it is damaged."""
    manifest = CorpusManifest.read(paths.corpus_manifest)
    if manifest is None:
        raise UserError(f"{paths.corpus_manifest} is missing: materialize the corpus asset first.")
    return manifest


def corpus_is_current(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, *,
                      fingerprint: str | None = None) -> bool:
    """The corpus on disk was built under ``fingerprint`` (corpus_fingerprint's, computed when not given) and
    its split files are unchanged."""
    try:
        doc = read_record(paths.corpus_manifest)
        manifest = CorpusManifest.read(paths.corpus_manifest, doc)
    except DamagedRecord:  # status says so; the corpus is built again
        return False
    fingerprint = corpus_fingerprint(paths, settings, materials) if fingerprint is None else fingerprint
    if manifest is None or manifest.fingerprint != fingerprint:
        return False
    # By stamp (size, mtime, inode); the content only when those are unsure, then the new stamp is kept.
    if set(manifest.splits) != set(SPLITS):
        return False
    now = {s: verify.confirmed(paths.corpus_file(s), manifest.splits[s]) for s in SPLITS}
    if any(record is None for record in now.values()):
        return False
    verify.store_refreshed(paths.corpus_manifest, doc, {**doc, "splits": {**manifest.splits, **now}})
    return True


CORPUS_STAGE = Stage(
    "corpus", "Corpus", record=lambda paths, settings: paths.corpus_manifest, settings=corpus_stage_settings,
    fingerprint=lambda chain: corpus_fingerprint(chain.paths, chain.settings, chain_materials(chain)),
    is_current=lambda chain: corpus_is_current(chain.paths, chain.settings, chain_materials(chain),
                                               fingerprint=chain.fingerprint("corpus")),
    stale_because="a prompt source changed (a local prompt file, or a dataset's pin) or the corpus files did")
