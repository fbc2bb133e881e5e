"""Each training run keeps its own exported GGUF and report, so going back to a run restores them without
training or exporting again (`gguf-trainer runs DIR --use RUN`, lib/runs/changes.py).

    checkpoints/<fingerprint>/export/<adapter_name>.gguf   a verified copy of the GGUF the export wrote
    checkpoints/<fingerprint>/export/kept.json              its size and sha256, the export's sidecar as
                                                             written, and the report made of that export

The export and the report write them when they finish (``keep_export``, ``keep_report``); the files in the
output folder stay where users and ggk know them. The copy is checked by sha256 before it is put back
(``restore_kept``), and every path in kept.json is stored relative to the project folder, like the sidecar's.
No torch here: `gguf-trainer runs` reads it.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.output.export_run import gguf_path
from gguf_assets.lib.project.layout import KEPT_DIR, KEPT_FILE, REPORT_JSON, REPORT_MD, ProjectPaths
from gguf_assets.lib.project.manifests import ExportSidecar
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.training.training_run import kept_dir, kept_gguf, read_kept

log = logging.getLogger(__name__)

KEPT_FORMAT = 1


def copy_verified(source: Path, folder: Path, *, sha256: str) -> Path:
    """Atomic copy into ``folder``; the copy's sha256 must match before it takes the final
    name, so a failed copy leaves any previous copy untouched."""
    target = Path(folder).expanduser() / Path(source).name
    with atomic.atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
        if atomic.sha256_file(tmp) != sha256:
            raise OSError(f"copy of {source} to {target} does not match its sha256; nothing was replaced "
                          f"(check the disk at {folder})")
    return target


def keep_export(paths: ProjectPaths, sidecar: ExportSidecar) -> Path | None:
    """After an export: a verified copy of its adapter GGUF, and its sidecar, in the run's folder; returns the
    copy (None when the run's folder is not in this project, as for an adapter trained elsewhere)."""
    fingerprint = sidecar.adapter_fingerprint
    run_dir = paths.checkpoints_dir(fingerprint) if fingerprint else None
    if run_dir is None or not run_dir.is_dir():
        return None
    folder = run_dir / KEPT_DIR
    atomic.remove_stale_temps(folder)
    previous = read_kept(paths, fingerprint)
    copy = copy_verified(Path(sidecar.path), folder, sha256=sidecar.sha256)
    atomic.write_json(folder / KEPT_FILE, {
        "format": KEPT_FORMAT, "fingerprint": fingerprint,
        "gguf": {"file": copy.name, "bytes": sidecar.bytes, "sha256": sidecar.sha256},
        "sidecar": paths.stored_doc(sidecar.to_json()), "report": None, "report_md": None})
    if previous and previous["gguf"]["file"] != copy.name:  # the adapter was renamed since: one copy is enough
        (folder / Path(previous["gguf"]["file"]).name).unlink(missing_ok=True)
    return copy


def keep_report(paths: ProjectPaths, sidecar: ExportSidecar, report_doc: dict, markdown: str) -> bool:
    """After the report: it joins the kept export it was made of (``report_doc`` as stored, relative paths).
    False when the run kept no export of that GGUF (nothing to join)."""
    fingerprint = sidecar.adapter_fingerprint
    kept = read_kept(paths, fingerprint) if fingerprint else None
    if kept is None or kept["gguf"]["sha256"] != sidecar.sha256 or kept["sidecar"].get("fingerprint") != \
            sidecar.fingerprint:
        return False
    atomic.remove_stale_temps(kept_dir(paths, fingerprint), of=[KEPT_FILE])  # a report cut off here before
    atomic.write_json(kept_dir(paths, fingerprint) / KEPT_FILE, {**kept, "report": report_doc, "report_md": markdown})
    return True


def keep_current(paths: ProjectPaths, settings: Settings) -> str | None:
    """Keep the output folder's current GGUF and report with their run, when they are not kept yet (an export
    made before runs kept theirs): done before anything replaces them. Returns the run's fingerprint, or None
    when there was nothing intact to keep."""
    target = gguf_path(paths, settings)
    try:
        doc = atomic.read_json(target.with_suffix(".json"))
        sidecar = ExportSidecar.from_json(paths.located_doc(doc))
    except (OSError, ValueError, TypeError):
        return None
    fingerprint = sidecar.adapter_fingerprint
    if not fingerprint or not paths.checkpoints_dir(fingerprint).is_dir():
        return None
    kept = read_kept(paths, fingerprint)
    if kept is not None and kept["gguf"]["sha256"] == sidecar.sha256 and kept.get("report"):
        return fingerprint
    if Path(sidecar.path) != target or not verify.unchanged(target, {"bytes": sidecar.bytes,
                                                                      "sha256": sidecar.sha256}):
        return None  # changed since its export: nothing trustworthy to keep
    if kept is None or kept["gguf"]["sha256"] != sidecar.sha256:
        keep_export(paths, sidecar)
    try:
        report_doc = atomic.read_json(paths.report_json(settings))
        markdown = paths.report_md(settings).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return fingerprint
    if report_doc.get("gguf_sha256") == sidecar.sha256:
        keep_report(paths, sidecar, report_doc, markdown)
    return fingerprint


@dataclass(frozen=True)
class Restored:
    """What ``restore_kept`` put back into the output folder (paths as written)."""

    gguf: Path
    copies: list[Path]
    report: Path | None


class NotRestorable(Exception):
    """Why a run's kept export cannot become the output folder's (the next run exports it again instead)."""


def restore_kept(paths: ProjectPaths, settings: Settings, fingerprint: str, *, gguf_fp: str,
                 report_fp: str | None) -> Restored:
    """Put the run's kept GGUF (checked by sha256), its copies (``output.also_copy_to``), its sidecar and its report
    back where ``settings`` put them, as if the export and the report had just been made.

    ``gguf_fp``/``report_fp``: the fingerprints the export and the report have under ``settings`` now; the kept
    ones must be those (NotRestorable otherwise, and nothing is written)."""
    kept = read_kept(paths, fingerprint)
    if kept is None:
        raise NotRestorable("it kept no export (it was exported before runs kept theirs, or never)")
    doc = kept["sidecar"]
    sidecar = ExportSidecar.from_json(paths.located_doc(doc))
    if sidecar.fingerprint != gguf_fp:
        raise NotRestorable("its kept export was made under other output settings or materials")
    target = gguf_path(paths, settings)
    if Path(sidecar.path) != target:
        raise NotRestorable(f"its kept export was written to {sidecar.path}, not {target}")
    source = kept_gguf(paths, fingerprint, kept)
    if not source.is_file() or atomic.sha256_file(source) != kept["gguf"]["sha256"]:
        raise NotRestorable(f"its kept GGUF {paths.stored(source)} is missing or changed (sha256 differs)")
    files = sidecar.written_files()
    originals = {f["path"] for f in files if not f.get("copy_of")}
    for entry in files:  # the vision GGUF is not kept (it depends on the materials alone): it must still be there
        if not entry.get("copy_of") and entry["role"] != "adapter" and not verify.unchanged(Path(entry["path"]),
                                                                                           entry):
            raise NotRestorable(f"{entry['path']}, which its export also wrote, changed since")
    atomic.remove_stale_temps(target.parent, of=[target.name])
    placed = copy_verified(source, target.parent, sha256=sidecar.sha256)
    copies = []
    for entry in files:  # the copies in output.also_copy_to, of the GGUF just placed (or of the vision GGUF)
        if entry.get("copy_of") in originals:
            copies.append(copy_verified(Path(entry["copy_of"]), Path(entry["path"]).parent, sha256=entry["sha256"]))
    # Fresh stamps: `status` then finds every file unchanged without reading it.
    refreshed = [{**f, **verify.stamp(Path(f["path"]))} for f in files]
    atomic.write_json(target.with_suffix(".json"), paths.stored_doc({**sidecar.to_json(), "files": refreshed}))
    report = None
    if kept.get("report") and kept.get("report_md") is not None and report_fp is not None \
            and kept["report"].get("fingerprint") == report_fp:
        out = paths.output_dir(settings)
        for json_file, md_file in ((paths.report_json(settings), paths.report_md(settings)),
                                   (out / REPORT_JSON, out / REPORT_MD)):
            atomic.write_json(json_file, kept["report"])
            atomic.write_text(md_file, kept["report_md"])
        report = paths.report_json(settings)
    log.info("restored %s from %s", placed, paths.stored(source))
    return Restored(placed, copies, report)
