"""The materials step: every configured source (teacher, student, prompt datasets, the optional vision encoder and
query rows) resolved to a folder and pinned, then ``materials/manifest.json`` written (what a pin is and when the
manifest is current: ``materials_run.py``).

Each source is a local folder or a hub repo id (``owner/name``, optionally ``@revision``). Hub repos are downloaded
into ``materials/hub/`` (layout in ``gguf_assets.lib.materials.hub``), only the files needed (``hub_files.py``):
config, tokenizer and safetensors weights (plus the query rows file of the teacher and a vision encoder's
preprocessor config) for models, data files for datasets. The commit is recorded in the manifest; a later run
reuses that commit, never a moved branch, until the configured source (for example its ``@revision``) changes.
Every folder is checked before anything loads it (``checks.py``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.materials import hub, hub_shapes, query_rows
from gguf_assets.lib.materials.materials_run import (
    TOKENIZER_ROLE,
    MaterialsError,
    hashed_files,
    load_manifest,
    materials_settings_key,
    pipeline_reads,
    pipeline_vision,
    write_manifest,
)
from gguf_assets.lib.materials.pinning import hub_files
from gguf_assets.lib.materials.pinning.checks import (
    check_folder,
    check_model_folder,
    check_query_rows_file,
    refuse_pipeline_problem,
)
from gguf_assets.lib.materials.student import from_gguf as gguf_student
from gguf_assets.lib.materials.teacher import layout
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import MODEL_ROLES, DamagedRecord, MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Material:
    role: str
    source: str
    path: str
    commit: str
    files: int
    bytes: int
    text_field: str | None = None
    origin: str = "local"  # local | hub
    kind: str | None = None  # a teacher's kind (lib/materials/teacher/layout.py)
    remote_code: dict | None = None  # an LLaDA-Image teacher's modeling files: {path: sha256}

    def entry(self) -> dict:
        """The manifest's entry; the teacher-only fields only where set (an older manifest compares equal)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in ("kind", "remote_code")}


def _hash_local_folder(folder: Path, cache: dict, read=None) -> tuple[str, int, int, dict]:
    """Content hash of a folder (``read``: the relative paths that count, default all); a file's sha256 is reused
    while its stamp (size, mtime, inode) matches."""
    entries, new_cache, total = [], {}, 0
    files = [p for _, p in sorted(hashed_files(folder, read).items())]
    for file in files:
        rel = file.relative_to(folder).as_posix()
        cached = cache.get(rel)
        entry = cached if cached and verify.stamp_matches(file, cached) else verify.record(file)
        new_cache[rel] = entry
        entries.append((rel, entry["sha256"]))
        total += entry["bytes"]
    return "local:" + atomic.fingerprint(entries), len(files), total, new_cache


def _resolve_local(role: str, source: str, local: Path, settings: Settings, cache: dict,
                   text_field: str | None) -> tuple[Material, dict]:
    kind, remote_code = check_folder(role, source, local, settings, where=f"in {local}")
    # A pipeline folder is pinned by the parts the teacher reads: its DiT and VAE are neither hashed nor watched.
    read = pipeline_reads(settings) if kind == layout.LLADA_IMAGE_PIPELINE else None
    commit, files, size, new_cache = _hash_local_folder(local if local.is_dir() else local.parent,
                                                        cache.get(str(local), {}), read)
    return (Material(role, source, str(local), commit, files, size, text_field, kind=kind, remote_code=remote_code),
            {str(local): new_cache})


def _resolve_hub(role: str, source: str, paths: ProjectPaths, settings: Settings, cache: dict, *,
                 pinned: str | None, text_field: str | None, token: str | None,
                 options: hub.HubOptions) -> tuple[Material, dict, dict]:
    ref = hub.RepoRef.parse(source, kind="dataset" if role == "datasets" else "model")
    root = paths.materials_dir / hub.HUB_DIR
    selection = hub_files.selection_key(role, settings)
    label = f"materials.{role} = {source!r}"
    report = {"source": source, "network": False, "downloaded_bytes": 0, "seconds": 0.0, "refetched": 0}
    checked_before_weights = False  # a pipeline's checks before its weights (teacher/preflight.py) ran here
    try:
        recorded = hub.read_record(root, ref, pinned) if pinned and \
            hub.record_selection(root, ref, pinned) == selection else None
        if recorded is not None and hub_files.holds_its_code(hub.snapshot_dir(root, ref, pinned), recorded):
            # A finished snapshot: check it against its record, offline; re-fetch only what changed.
            listing = recorded
            folder = hub.snapshot_dir(root, ref, pinned)
            bad, verified = hub.verify(folder, listing, cache.get(str(folder), {}))
            if bad:
                log.warning("%s: %s changed on disk since download; fetching again from %s",
                            label, ", ".join(bad), pinned[:12])
                report["network"] = True
                hub.remove_orphans(folder, listing)
                hub.check_disk(folder, ref, hub.to_download(folder, listing.subset(bad)),
                               reserve_bytes=options.disk_reserve_bytes)
                fixed, stats = hub.download(ref, listing.subset(bad), folder, token=token, options=options)
                verified.update(fixed)
                report.update(downloaded_bytes=stats.downloaded_bytes, seconds=stats.seconds,
                              refetched=stats.refetched + len(bad))
                hub.finish(folder, root, ref, listing, selection=selection)
        else:
            report["network"] = True
            full = hub.list_repo(ref, revision=pinned, token=token, options=options)
            folder = hub.snapshot_dir(root, ref, full.commit)
            pipeline = role == "teacher" and layout.teacher_kind(
                settings.materials.teacher_kind, full.files) == layout.LLADA_IMAGE_PIPELINE
            needs_query_rows = (role == "teacher" and teacher_choice(settings).loads_teacher_model and not pipeline
                                and not settings.materials.query_rows)  # else they are a material of their own
            if pipeline:
                try:
                    meta, weights = layout.pipeline_selection(full.files, vision=pipeline_vision(settings))
                except layout.LayoutError as exc:
                    raise MaterialsError(f"{label}: {exc} at {full.commit[:12]}. Point it at an LLaDA-Image "
                                         "pipeline repo, or set materials.teacher_kind.") from None
            elif role == "datasets":
                meta, weights = [], hub_files.select_dataset_files(source, full)
            elif role == TOKENIZER_ROLE:
                meta, weights = hub_files.select_tokenizer_files(source, full), []
            else:
                meta, weights = hub_files.select_model_files(role, source, full, settings,
                                                             needs_query_rows=needs_query_rows)
            if removed := hub.remove_orphans(folder, full.subset(meta + weights)):
                log.info("%s: removed %d orphan partial download(s)", label, removed)
            # What the per-user store can link needs no space of its own (hub/store.py).
            hub.check_disk(folder, ref, hub.to_download(folder, full.subset(meta + weights)),
                           reserve_bytes=options.disk_reserve_bytes)
            verified: dict = {}
            total = hub.TransferStats()

            def fetch(files: list[str]) -> None:
                if files:
                    done, stats = hub.download(ref, full.subset(files), folder, token=token, options=options,
                                               cache=cache.get(str(folder), {}))
                    verified.update(done)
                    total.downloaded_bytes += stats.downloaded_bytes
                    total.seconds += stats.seconds
                    total.refetched += stats.refetched

            fetch(meta)  # small files first: remote code and the weight index are known before the big ones
            if pipeline:  # its modeling code is fetched and shown (with sha256) before any weight, or refused
                extra, weights = hub_files.refine_pipeline_files(source, folder, full, weights, fetch)
                meta += extra
                if not settings.materials.trust_remote_code:
                    raise MaterialsError(layout.remote_code_refusal(source, f"at commit {full.commit}",
                                                                    layout.remote_code_hashes(folder, extra)))
                # Everything that can fail without the weights fails now: their headers are read by range.
                refuse_pipeline_problem(source, folder, settings, where=f"at commit {full.commit}",
                                        header_of=hub_shapes.range_headers(
                                            ref, full, folder / hub.HF_CACHE_DIR / "headers", token=token,
                                            options=options))
                checked_before_weights = True
            elif role not in ("datasets", TOKENIZER_ROLE):
                extra, weights = hub_files.refine_model_files(role, source, folder, full, settings, weights)
                fetch(extra)
                meta += extra
            fetch(weights)
            listing = full.subset(meta + weights)
            hub.finish(folder, root, ref, listing, selection=selection)
            report.update(downloaded_bytes=total.downloaded_bytes, seconds=round(total.seconds, 2),
                          refetched=total.refetched)
            log.info("%s: pinned to %s (%d files, %.1f MiB fetched)", label, listing.commit,
                     len(listing.files), total.downloaded_bytes / 2**20)
    except hub.HubError as exc:
        raise MaterialsError(f"{label}: {exc}") from None
    kind, remote_code = check_folder(role, source, folder, settings, where=f"at commit {listing.commit}",
                                     preflight=not checked_before_weights)
    material = Material(role, source, str(folder), listing.commit, len(listing.files), listing.total_bytes,
                        text_field, origin="hub", kind=kind, remote_code=remote_code)
    return material, {str(folder): verified}, report


def _resolve(role: str, source: str, paths: ProjectPaths, settings: Settings, cache: dict, *,
             text_field: str | None = None, pinned: str | None = None, token: str | None = None,
             options: hub.HubOptions | None = None) -> tuple[Material, dict, dict | None]:
    local = paths.resolve_local(source)
    if local.exists():
        return (*_resolve_local(role, source, local, settings, cache, text_field), None)
    if hub.is_repo_source(source):
        return _resolve_hub(role, source, paths, settings, cache, pinned=pinned, text_field=text_field,
                            token=token, options=options or hub.HubOptions())
    raise MaterialsError(f"materials.{role} = {source!r}: no such folder ({local}) and not a hub repo id "
                         "(owner/name, optionally @revision).")


def _resolve_gguf_student(source: str, paths: ProjectPaths, settings: Settings, cache: dict, old: dict | None, *,
                          token: str | None, options: hub.HubOptions | None) -> tuple[Material, dict, list, dict]:
    """A GGUF student (materials.student = a local .gguf file): converted once per content (and tokenizer) into the
    transformers Qwen3 folder materials/student-gguf/<sha256 prefix>-<key>/, which everything downstream reads.

    Returns the student's Material (its path the converted folder, its commit ``local:`` + the fingerprint of the
    GGUF's sha256 and the tokenizer's pin), the hash cache of the tokenizer and the converted folder, the tokenizer's
    download report (a hub tokenizer) and the ``gguf`` record the manifest keeps beside the entry (the file's stamp
    and sha256, the tokenizer's Material), by which a rerun knows the file without reading it again."""
    label = f"materials.student = {source!r}"
    local = paths.resolve_local(source)
    if not local.is_file():
        raise MaterialsError(f"{label}: no such file ({local}). A GGUF student is read from a local file; a hub-hosted "
                             "GGUF is not fetched: download it and point materials.student at the file.")
    tok_source = settings.materials.student_tokenizer
    if not tok_source:
        raise MaterialsError(f"{label} is a GGUF file, which carries no tokenizer the product reads: set "
                             f"materials.{TOKENIZER_ROLE} to the folder or hub repo holding its tokenizer.json.")
    old_gguf = (old or {}).get("gguf") if (old or {}).get("source") == source else None
    old_tok = (old_gguf or {}).get("tokenizer") or {}
    pinned = old_tok.get("commit") if old_tok.get("source") == tok_source and old_tok.get("origin") == "hub" else None
    tok, tok_cache, report = _resolve(TOKENIZER_ROLE, tok_source, paths, settings, cache, pinned=pinned, token=token,
                                      options=options)
    tok_folder = Path(tok.path)
    problem = gguf_student.tokenizer_folder_problem(tok_folder)
    if problem:
        raise MaterialsError(f"materials.{TOKENIZER_ROLE} = {tok_source!r}: {problem}")
    # The GGUF's sha256: read again only when its stamp (size, mtime, inode) differs from the last run's.
    previous = (old_gguf or {}).get("file")
    record = verify.confirmed(local, previous) if previous and old_gguf.get("path") == str(local) else None
    if record is None:
        log.info("%s: hashing %s (%.1f MiB)", label, local, local.stat().st_size / 2**20)
        record = verify.record(local)
    folder = gguf_student.converted_folder(paths.materials_dir, record["sha256"], tok.commit)
    folder_cache = cache.get(str(folder), {})
    reuse = gguf_student.is_converted(folder, record["sha256"], tok.commit) and bool(folder_cache) \
        and _unchanged_folder(folder, folder_cache)
    if not reuse:
        try:
            gguf_student.convert_student_gguf(local, tok_folder, folder, gguf_sha256=record["sha256"],
                                              tokenizer_commit=tok.commit)
        except gguf_student.StudentGgufError as exc:
            raise MaterialsError(f"{label}: {exc}") from None
        folder_cache = {}
    for stale in gguf_student.remove_other_conversions(paths.materials_dir, folder):
        log.info("removed %s (the conversion of another GGUF student or tokenizer)", stale)
    check_model_folder("student", source, folder, settings)
    _, files, size, new_folder_cache = _hash_local_folder(folder, folder_cache)
    commit = "local:" + atomic.fingerprint([record["sha256"], tok.commit, gguf_student.CONVERTER_VERSION])
    material = Material("student", source, str(folder), commit, files, size)
    extra = {"path": str(local), "file": record, "tokenizer": tok.entry()}
    reports = [{"role": TOKENIZER_ROLE, **report}] if report else []
    return material, {**tok_cache, str(folder): new_folder_cache}, reports, extra


def _unchanged_folder(folder: Path, files: dict) -> bool:
    """Whether ``folder`` holds exactly the files ``files`` recorded, with that content (by stamp, else sha256)."""
    current = hashed_files(folder)
    return set(current) == set(files) and all(verify.confirmed(current[rel], entry) is not None
                                              for rel, entry in files.items())


def _pinned_commit(old: MaterialsManifest, role: str, source: str) -> str | None:
    """The commit an earlier run pinned this exact source to, if it came from the hub."""
    entries = old.datasets if role == "datasets" else [getattr(old, role)]
    for entry in entries:
        if entry and entry.get("source") == source and entry.get("origin") == "hub":
            return entry["commit"]
    return None


def resolve_materials(paths: ProjectPaths, settings: Settings, *, token: str | None = None,
                      hub_options: hub.HubOptions | None = None) -> MaterialsManifest:
    """Resolve and pin every configured source; write materials/manifest.json; return it.

    ``token`` is the HF token for gated or private repos (None: send none); it is never stored.
    """
    try:  # the last manifest's hashes and downloads save work; a damaged one only costs re-hashing
        old = load_manifest(paths) if paths.materials_manifest.is_file() else MaterialsManifest()
    except DamagedRecord as exc:
        log.warning("%s is damaged (%s); the materials are checked again from scratch", exc.path, exc.why)
        old = MaterialsManifest()
    cache = old.hash_cache
    new_cache: dict = {}
    downloads: list[dict] = []
    manifest = MaterialsManifest()
    m = settings.materials
    needs_teacher = teacher_choice(settings).loads_teacher_model
    wanted: list[tuple[str, str, str | None]] = []
    for role in MODEL_ROLES:
        source = getattr(m, role)
        # The mock teacher (or student-only mode) never loads the teacher: nothing is downloaded for it.
        if not source or (role == "teacher" and not needs_teacher and not paths.resolve_local(source).exists()):
            continue
        wanted.append((role, source, None))
    wanted += [("datasets", ds.source, ds.text_field) for ds in settings.dataset_sources()]
    for role, source, text_field in wanted:
        if role == "student" and gguf_student.is_gguf_source(source):
            material, c, reports, extra = _resolve_gguf_student(source, paths, settings, cache, old.student,
                                                                token=token, options=hub_options)
            manifest.student = {**material.entry(), "gguf": extra}
            new_cache.update(c)
            downloads += reports
            continue
        material, c, report = _resolve(role, source, paths, settings, cache, text_field=text_field,
                                       pinned=_pinned_commit(old, role, source), token=token, options=hub_options)
        if role == "datasets":
            manifest.datasets.append(material.entry())
        else:
            setattr(manifest, role, material.entry())
        new_cache.update(c)
        if report:
            downloads.append({"role": role, **report})
    pipeline = (manifest.teacher or {}).get("kind") == layout.LLADA_IMAGE_PIPELINE
    if pipeline and needs_teacher and pipeline_vision(settings):
        manifest.vision_encoder = _pipeline_vision_encoder(manifest.teacher)
    if pipeline:  # its conditioning rows come from its QueryFormer, not from query rows
        pass
    elif manifest.teacher and needs_teacher and m.query_rows:
        manifest.query_rows = _resolve_query_rows(paths, settings, Path(manifest.teacher["path"]), old.query_rows,
                                                  token=token, options=hub_options)
    elif manifest.teacher and needs_teacher:
        check_query_rows_file(Path(manifest.teacher["path"]), settings)
    in_use = {Path(folder) for folder in new_cache}
    for stale in hub.remove_unfinished_snapshots(paths.materials_dir / hub.HUB_DIR, keep=in_use):
        log.info("removed the unfinished download %s (no longer configured)", stale)
    manifest.hash_cache, manifest.downloads = new_cache, downloads
    manifest.settings = materials_settings_key(settings)
    manifest.settings_hash = settings_history.remember(paths.root, settings)
    write_manifest(paths, manifest)
    return manifest


def _pipeline_vision_encoder(teacher: dict) -> dict:
    """The vision encoder an LLaDA-Image teacher brings: its sigvq/ folder, pinned with the teacher."""
    folder = Path(teacher["path"]) / layout.VISION_DIR
    files = [p for p in folder.rglob("*") if p.is_file()]
    return Material("vision_encoder", f"{teacher['source']} ({layout.VISION_DIR}/)", str(folder), teacher["commit"],
                    len(files), sum(p.stat().st_size for p in files), origin=teacher.get("origin", "local")).entry()


def _resolve_query_rows(paths: ProjectPaths, settings: Settings, teacher: Path, old: dict | None, *,
                        token: str | None, options: hub.HubOptions | None) -> dict:
    """materials.query_rows: one tensor of a local or hub safetensors file, fetched by range and stored alone."""
    qr = settings.materials.query_rows
    try:
        entry = query_rows.resolve(qr, paths.materials_dir, paths.resolve_local(qr["source"]), teacher, old,
                                   is_repo=hub.is_repo_source(qr["source"]), token=token,
                                   options=options or hub.HubOptions())
    except hub.HubError as exc:
        raise MaterialsError(f"{query_rows.SETTING}.source = {qr['source']!r}: {exc}") from None
    if entry is not old:
        log.info("%s: %s", query_rows.SETTING, query_rows.describe(entry))
    return entry
