"""What an export is: where the GGUF goes, the settings it depends on, its fingerprint and whether the files
it wrote are current. No torch or numpy here: `status` and the planner read it (lib/status/), and so does the
export (lib/output/export.py) to record the fingerprint it is made under.

The fingerprint chains the adapter's, with the pinned student, teacher and vision encoder and the settings
that change what is written or where it is copied; the export is deterministic, so it stands for the bytes.
"""

from __future__ import annotations

from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.materials.materials_run import chain_materials
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import ProjectPaths, RecordPathError
from gguf_assets.lib.project.manifests import (
    DamagedRecord,
    ExportSidecar,
    MaterialsManifest,
    read_record,
    recorded_fingerprint,
)
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Stage

GGUF_SUFFIX = ".gguf"


def gguf_path(paths: ProjectPaths, settings: Settings) -> Path:
    return paths.output_dir(settings) / f"{settings.output.adapter_name}{GGUF_SUFFIX}"


def gguf_settings(settings: Settings) -> dict:
    """The settings the export's fingerprint holds (the models enter it through their pins)."""
    # also_copy_to is here because the copy is part of the export: a new folder must get one.
    o = settings.output
    return {"name": o.adapter_name, "template": settings.precompute.prompt_template,
            "export_vision_encoder": o.export_vision_encoder, "also_copy_to": o.also_copy_to}


def gguf_stage_settings(settings: Settings) -> dict:
    """What the export is computed from, as settings/gguf shows it: its fingerprint's settings, the output folder
    (it places the file: a new one makes the export missing) and the vision encoder's source (it reaches the
    fingerprint as a pin)."""
    return {**gguf_settings(settings), "output_dir": settings.output.output_dir,
            "vision": settings.materials.vision_encoder}


def gguf_fingerprint(settings: Settings, materials: MaterialsManifest, adapter_fp: str) -> str:
    s = gguf_settings(settings)
    return atomic.fingerprint({"adapter": adapter_fp, "name": s["name"], "template": s["template"],
                               "student": materials.pin("student"), "teacher": materials.pin("teacher"),
                               "vision": [materials.pin("vision_encoder"), s["export_vision_encoder"]],
                               "also_copy_to": s["also_copy_to"], "format": formats.GGUF_EXPORT})


def export_sidecar(paths: ProjectPaths, settings: Settings) -> ExportSidecar:
    """The export's sidecar (<adapter_name>.json beside the GGUF), with absolute paths."""
    return ExportSidecar.from_json(paths.located_doc(atomic.read_json(gguf_path(paths, settings).with_suffix(".json"))))


def delivered_file(paths: ProjectPaths, settings: Settings, stored: str, *, record: Path) -> Path:
    """A file the export's record names, confined to where the export writes: the output folder, or
    output.also_copy_to (the user's own copy). RecordPathError, naming the record, for anything else."""
    folders = [paths.output_dir(settings)]
    if settings.output.also_copy_to:
        folders.append(paths.resolve_local(settings.output.also_copy_to))
    for folder in folders[:-1]:
        try:
            return paths.inside(stored, record=record, under=folder)
        except RecordPathError:
            continue
    return paths.inside(stored, record=record, under=folders[-1])


def exported_files_unchanged(paths: ProjectPaths, settings: Settings) -> bool:
    """Every file the export wrote (GGUF, vision GGUF, copies) still holds what it wrote.

    Checked by size, mtime and inode; the content is read only when those are unsure, and the new stamps
    are then stored (a copied project is hashed once, not at every `status`). A copy in a folder that
    another project also exports to counts as changed once that project writes it.
    """
    record = gguf_path(paths, settings).with_suffix(".json")
    try:
        doc = read_record(record)
        sidecar = ExportSidecar.read(record, paths.located_doc(doc)) if doc is not None else None
    except DamagedRecord:
        return False
    if sidecar is None:
        return False
    files = sidecar.written_files()
    try:  # a received project's record that names a file elsewhere is not this export's: it is made again
        now = [verify.confirmed(delivered_file(paths, settings, f["path"], record=record), f) for f in files]
    except RecordPathError:
        return False
    if any(entry is None for entry in now):
        return False
    if sidecar.files:
        stamps = [{k: entry[k] for k in verify.STAMP_KEYS} for entry in now]
        verify.store_refreshed(record, doc, {**doc, "files": [{**f, **st} for f, st in zip(doc["files"], stamps)]})
    return True


def gguf_is_current(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, adapter_fp: str, *,
                    fingerprint: str | None = None) -> bool:
    """The sidecar names the fingerprint the export has when made now from the adapter ``adapter_fp``
    (``fingerprint``, when computed already), and every file it wrote is unchanged."""
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    fingerprint = gguf_fingerprint(settings, materials, adapter_fp) if fingerprint is None else fingerprint
    return recorded_fingerprint(sidecar) == fingerprint and exported_files_unchanged(paths, settings)


GGUF_STAGE = Stage(
    "gguf", "GGUF export", record=lambda paths, settings: gguf_path(paths, settings).with_suffix(".json"),
    settings=gguf_stage_settings,
    fingerprint=lambda chain: gguf_fingerprint(chain.settings, chain_materials(chain), chain.fingerprint("adapter")),
    is_current=lambda chain: gguf_is_current(chain.paths, chain.settings, chain_materials(chain),
                                             chain.fingerprint("adapter"), fingerprint=chain.fingerprint("gguf")),
    files_changed="an exported file changed on disk or is gone (`gguf-trainer run` exports again)",
    stale_because="the adapter was retrained since the export")
