"""What the materials step made: ``materials/manifest.json``, the settings it was resolved under, its fingerprint and
whether it is current. No torch here: `status` and every later stage read the manifest through this module; the
materials step (``pinning/``) resolves the sources and writes it with ``write_manifest``.

Every resolved source is pinned: a hub download to the commit it resolved to, a local folder to a content hash of
its files. Downstream fingerprints use that pin, so an edited teacher folder makes its targets stale instead of
being silently reused. The manifest is current while the settings are those it was resolved under and every
pinned file still matches its record: by stamp (size, mtime, inode), by content when the stamp is unsure (a hub
file against the hub's etag, a local one against its sha256), then the new stamp is kept.
"""

from __future__ import annotations

import copy
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials import hub, query_rows
from gguf_assets.lib.materials.teacher import layout
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import DamagedRecord, MaterialsManifest, read_record
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Chain, Stage
from gguf_assets.lib.project.teacher_choice import teacher_choice

TOKENIZER_ROLE = "student_tokenizer"  # materials.student_tokenizer: the tokenizer of a GGUF student


class MaterialsError(UserError, RuntimeError):
    """A source that cannot be used; the message names it and the fix."""


def load_manifest(paths: ProjectPaths) -> MaterialsManifest:
    """The materials manifest, with absolute paths for this project folder wherever it is now."""
    stored = read_record(paths.materials_manifest)  # DamagedRecord names the file when it cannot be read
    if stored is None:
        raise MaterialsError(f"{paths.materials_manifest} is missing: materialize the materials asset first.")
    manifest = MaterialsManifest.read(paths.materials_manifest, paths.located_doc(stored))
    manifest.hash_cache = {str(paths.located(folder)): files for folder, files in stored.get("_hash_cache", {}).items()}
    return manifest


def write_manifest(paths: ProjectPaths, manifest: MaterialsManifest) -> None:
    """Written with paths relative to the project folder (see ProjectPaths.stored)."""
    atomic.write_json(paths.materials_manifest, _stored_form(paths, manifest))


def _stored_form(paths: ProjectPaths, manifest: MaterialsManifest) -> dict:
    stored = paths.stored_doc(manifest.to_json())
    # The folders are the cache's keys, which stored_doc leaves as they are.
    stored["_hash_cache"] = {paths.stored(folder): files for folder, files in manifest.hash_cache.items()}
    return stored


def materials_settings_key(settings: Settings) -> dict:
    """The settings a materials manifest was resolved under (the layers are read later, by the shards).

    ``query_rows``, ``student_tokenizer`` and ``teacher_kind`` enter only when set: a project resolved before the
    key existed stays current."""
    m = {k: v for k, v in settings.section_dict("materials").items()
         if k not in ("teacher_layer", "student_layer")
         and not (k in ("query_rows", TOKENIZER_ROLE) and not v) and not (k == "teacher_kind" and v == layout.AUTO)}
    choice = teacher_choice(settings)
    key = {**m, "mode": choice.mode, "mock_teacher": choice.mock}
    if pipeline_vision(settings):  # an LLaDA-Image teacher's sigvq/ is fetched
        key["teacher_vision"] = True
    return key


def materials_fingerprint(settings: Settings) -> str:
    """The materials' fingerprint: their settings (the pins they resolve to are the next stages' inputs)."""
    return atomic.fingerprint(materials_settings_key(settings))


def manifest_is_current(paths: ProjectPaths, settings: Settings) -> bool:
    """True if the manifest was made under these settings and no local source changed on disk."""
    if not paths.materials_manifest.is_file():
        return False
    try:
        manifest = load_manifest(paths)
    except DamagedRecord:  # status says so; the materials step writes it again
        return False
    if manifest.settings != materials_settings_key(settings):
        return False
    if settings.materials.query_rows:
        entry = manifest.query_rows
        if not entry or entry.get("key") != query_rows.setting_key(settings.materials.query_rows) \
                or not Path(entry["path"]).is_file() or verify.confirmed(Path(entry["path"]), entry["stored"]) is None:
            return False
    stored = copy.deepcopy(manifest)
    gguf = (manifest.student or {}).get("gguf")
    if gguf:  # a GGUF student: the user's file, by stamp, else by content (its converted folder is in the cache)
        now = verify.confirmed(Path(gguf["path"]), gguf["file"]) if Path(gguf["path"]).is_file() else None
        if now is None:
            return False
        gguf["file"] = now
    teacher = manifest.teacher or {}
    pipeline = teacher.get("kind") == layout.LLADA_IMAGE_PIPELINE and teacher.get("origin") == "local"
    for folder, files in manifest.hash_cache.items():
        root = Path(folder)
        current = hashed_files(root, pipeline_reads(settings) if pipeline and folder == teacher["path"] else None)
        if set(current) != set(files):
            return False
        for rel, entry in files.items():
            # By stamp; by content when it is unsure (a copied folder), then the new stamp is kept.
            # The content of a hub file is checked against the hub's etag, of a local one against its sha256.
            if "etag" in entry or "verified" in entry:
                known = hub.still_verified(current[rel], entry)
                if known is None and hub.matches_etag(current[rel], hub.recorded_etag(entry)):
                    files[rel] = hub.verified_entry(current[rel], hub.recorded_etag(entry))
                elif not known:
                    return False
                continue
            if "key" in entry:  # a local file recorded before stamps: "size:mtime_ns"
                stat = current[rel].stat()
                if entry["key"] != f"{stat.st_size}:{stat.st_mtime_ns}":
                    return False
                continue
            now = verify.confirmed(current[rel], entry)
            if now is None:
                return False
            files[rel] = now
    verify.store_refreshed(paths.materials_manifest, _stored_form(paths, stored), _stored_form(paths, manifest))
    return True


def pipeline_vision(settings: Settings) -> bool:
    """Whether an LLaDA-Image teacher's sigvq/ is fetched: the vision export is on and no other encoder is set."""
    return settings.output.export_vision_encoder and not settings.materials.vision_encoder


def pipeline_reads(settings: Settings):
    """Which files of an LLaDA-Image pipeline folder its pin counts: its DiT and VAE are neither hashed nor watched."""
    vision = pipeline_vision(settings)
    return lambda rel: layout.is_read(rel, vision=vision)


def hashed_files(folder: Path, read=None) -> dict[str, Path]:
    """{relative path: path} of a folder's files (``read``: the relative paths that count, default all)."""
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
             if p.is_file() and not p.name.startswith(atomic.TEMP_PREFIX)} if folder.is_dir() else {}
    return {rel: p for rel, p in files.items() if read is None or read(rel)}


def chain_materials(chain: Chain) -> MaterialsManifest:
    """The materials manifest, read once per status question (raises as load_manifest does)."""
    return chain.once("materials", lambda: load_manifest(chain.paths))


MATERIALS_STAGE = Stage(
    "materials", "Materials", record=lambda paths, settings: paths.materials_manifest,
    settings=materials_settings_key, fingerprint=lambda chain: materials_fingerprint(chain.settings),
    is_current=lambda chain: manifest_is_current(chain.paths, chain.settings),
    stale_because="a material changed on disk since it was pinned")
