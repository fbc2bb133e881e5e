"""Materials: teacher, student, prompt datasets and the optional vision encoder.

Each source is a local folder or a hub repo id (``owner/name``, optionally ``@revision``). Every
resolved source is pinned: a hub download to the commit it resolved to, a local folder to a
content hash of its files. Downstream fingerprints use that pin, so an edited teacher folder makes
its targets stale instead of being silently reused.

Hub repos are downloaded into ``materials/hub/`` (layout in ``gguf_assets.lib.materials.hub``), only the
files needed: config, tokenizer and safetensors weights (plus the query rows file of the teacher
and a vision encoder's preprocessor config) for models, data files for datasets. The commit is
recorded in ``materials/manifest.json``; a later run reuses that commit, never a moved branch,
until the configured source (for example its ``@revision``) changes.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import LLADA_IMAGE
from gguf_assets.lib.core.safetensors_io import safetensors_header
from gguf_assets.lib.materials import hub, hub_shapes, query_rows, teacher_preflight
from gguf_assets.lib.materials import student_from_gguf as gguf_student
from gguf_assets.lib.materials import teacher_layout as layout
from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem
from gguf_assets.lib.materials.student_contract import student_contract_problem
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.formats import PROMPT_FILE_SUFFIXES
from gguf_assets.lib.project.layout import DATASET_METADATA_FILES, ProjectPaths
from gguf_assets.lib.project.manifests import MODEL_ROLES, DamagedRecord, MaterialsManifest, read_record
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice

log = logging.getLogger(__name__)

# What a model needs besides its weights: config, tokenizer, generation and preprocessor configs.
MODEL_META_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
WEIGHTS_SUFFIX = ".safetensors"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
REMOTE_CODE_SUFFIX = ".py"
TOKENIZER_ROLE = "student_tokenizer"  # materials.student_tokenizer: the tokenizer of a GGUF student


class MaterialsError(UserError, RuntimeError):
    """A source that cannot be used; the message names it and the fix."""


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
    kind: str | None = None  # a teacher's kind (lib/materials/teacher_layout.py)
    remote_code: dict | None = None  # an LLaDA-Image teacher's modeling files: {path: sha256}

    def entry(self) -> dict:
        """The manifest's entry; the teacher-only fields only where set (an older manifest compares equal)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in ("kind", "remote_code")}


def _folder_files(folder: Path, read=None) -> dict[str, Path]:
    """{relative path: path} of a folder's files (``read``: the relative paths that count, default all)."""
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
             if p.is_file() and not p.name.startswith(atomic.TEMP_PREFIX)} if folder.is_dir() else {}
    return {rel: p for rel, p in files.items() if read is None or read(rel)}


def _hash_local_folder(folder: Path, cache: dict, read=None) -> tuple[str, int, int, dict]:
    """Content hash of a folder (``read``: the relative paths that count, default all); a file's sha256 is reused
    while its stamp (size, mtime, inode) matches."""
    entries, new_cache, total = [], {}, 0
    files = [p for _, p in sorted(_folder_files(folder, read).items())]
    for file in files:
        rel = file.relative_to(folder).as_posix()
        cached = cache.get(rel)
        entry = cached if cached and verify.stamp_matches(file, cached) else verify.record(file)
        new_cache[rel] = entry
        entries.append((rel, entry["sha256"]))
        total += entry["bytes"]
    return "local:" + atomic.fingerprint(entries), len(files), total, new_cache


def _model_weights(role: str, source: str, names: list[str], settings: Settings, *, pickles_fix: str,
                   none_fix: str) -> list[str]:
    """The model's weight files among a folder's (or repo's) top-level file names, refused before any load or
    download when transformers could not load them: only pickles (they can run code), none at all, or
    safetensors under names transformers does not look for. The query rows file is not weights."""
    weights = sorted(n for n in names if n.endswith(WEIGHTS_SUFFIX) and n != settings.materials.query_rows_file)
    if not weights:
        pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise MaterialsError(f"materials.{role} = {source!r} has only pickle weights ({', '.join(pickles[:4])}), "
                                 f"which are refused because loading them can run code. {pickles_fix}")
        raise MaterialsError(f"materials.{role} = {source!r}: {none_fix}")
    if WEIGHTS_FILE not in names and WEIGHTS_INDEX not in names:
        raise MaterialsError(f"materials.{role} = {source!r}: its weights ({', '.join(weights[:4])}) are not named "
                             f"{WEIGHTS_FILE}, nor listed by {WEIGHTS_INDEX}, which is what transformers loads. "
                             f"Rename a single file to {WEIGHTS_FILE}, or add the index that names the shards.")
    return weights


def _check_model_folder(role: str, source: str, folder: Path, settings: Settings) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MaterialsError(f"materials.{role} = {source!r}: {folder} has no config.json; point it at a "
                             "transformers model folder (config, tokenizer and *.safetensors).")
    weights = [folder / name for name in _model_weights(
        role, source, [p.name for p in folder.iterdir() if p.is_file()], settings,
        pickles_fix="Convert them to safetensors first (safetensors loads no code).",
        none_fix=f"no *.safetensors weights in {folder}; point it at a transformers model folder.")]
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("auto_map") and not settings.materials.trust_remote_code:
        raise MaterialsError(f"materials.{role} = {source!r} needs remote code (config.json has auto_map). "
                             "It is refused by default; set materials.trust_remote_code: true only if you trust it.")
    for file in sorted(weights):  # headers only: a truncated file fails here, not deep inside a load
        try:
            safetensors_header(file)
        except ValueError as exc:
            raise MaterialsError(f"materials.{role} = {source!r}: {exc}. Copy or download that file again "
                                 "(a hub download is checked and fetched again by `gguf-trainer run`).") from None
    _check_tokenizer_fits(role, source, folder, config)
    if role == "student":  # ggk runs it: refused now, before any precompute, if ggk would run it otherwise
        problem = student_contract_problem(folder) or ggk_tokenizer_problem(folder)
        if problem:
            raise MaterialsError(f"materials.student = {source!r}: {problem}")


def _check_tokenizer_fits(role: str, source: str, folder: Path, config: dict) -> None:
    """Token ids index the embedding table: a tokenizer larger than it fails later as an IndexError."""
    tokenizer_file = folder / "tokenizer.json"
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not tokenizer_file.is_file() or not isinstance(vocab, int):
        return
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
    if tokens > vocab:
        raise MaterialsError(f"materials.{role} = {source!r}: its tokenizer ({tokenizer_file}) has {tokens} tokens, "
                             f"but config.json's vocab_size (the embedding rows) is {vocab}, so token ids from "
                             f"{vocab} up have no embedding. Use the tokenizer that belongs to this model.")


def _resolve_local(role: str, source: str, local: Path, settings: Settings, cache: dict,
                   text_field: str | None) -> tuple[Material, dict]:
    kind, remote_code = _check_folder(role, source, local, settings, where=f"in {local}")
    # A pipeline folder is pinned by the parts the teacher reads: its DiT and VAE are neither hashed nor watched.
    read = _pipeline_reads(settings) if kind == layout.LLADA_IMAGE_PIPELINE else None
    commit, files, size, new_cache = _hash_local_folder(local if local.is_dir() else local.parent,
                                                        cache.get(str(local), {}), read)
    return (Material(role, source, str(local), commit, files, size, text_field, kind=kind, remote_code=remote_code),
            {str(local): new_cache})


def _check_folder(role: str, source: str, folder: Path, settings: Settings, *, where: str,
                  preflight: bool = True) -> tuple[str | None, dict | None]:
    """Check a resolved model folder before anything loads it; (the teacher's kind, its remote code hashes).
    ``preflight`` False: a pipeline's checks before its weights ran already (a hub download)."""
    if role not in MODEL_ROLES:
        return None, None
    if role != "teacher" or not folder.is_dir():
        _check_model_folder(role, source, folder, settings)
        return None, None
    kind = layout.teacher_kind(settings.materials.teacher_kind, layout.folder_files(folder))
    if kind == layout.QUERY_ROWS:
        _check_model_folder(role, source, folder, settings)
        return kind, None
    unused = _unused_by_a_pipeline(settings)
    if unused:
        raise MaterialsError(f"materials.teacher = {source!r} is an LLaDA-Image pipeline, which {unused}")
    return kind, _check_pipeline_folder(source, folder, settings, where=where, preflight=preflight)


def _unused_by_a_pipeline(settings: Settings) -> str | None:
    """A setting of the query-rows kind that a pipeline would silently ignore, said with the fix; None if none."""
    m, p = settings.materials, settings.precompute
    if p.prompt_template not in ("{prompt}", LLADA_IMAGE):
        return (f"renders the prompt with its own template: precompute.prompt_template = {p.prompt_template!r} would "
                "be ignored. Remove the key (or set it to llada-image)")
    if m.teacher_layer != -1:
        return (f"conditions on its text projection's output, not a backbone layer: materials.teacher_layer = "
                f"{m.teacher_layer} would be ignored. Remove the key")
    if m.query_rows:
        return "makes its rows with its QueryFormer: materials.query_rows would be ignored. Remove the key"
    return None


def _pipeline_reads(settings: Settings):
    vision = pipeline_vision(settings)
    return lambda rel: layout.is_read(rel, vision=vision)


def pipeline_vision(settings: Settings) -> bool:
    """Whether an LLaDA-Image teacher's sigvq/ is fetched: the vision export is on and no other encoder is set."""
    return settings.output.export_vision_encoder and not settings.materials.vision_encoder


def _check_pipeline_folder(source: str, folder: Path, settings: Settings, *, where: str,
                           preflight: bool = True) -> dict:
    """An LLaDA-Image pipeline's text stack, refused before any load when a part is missing or its code is not
    allowed; returns its modeling files' sha256 (a part of the targets' fingerprint)."""
    problem = layout.pipeline_folder_problem(folder, vision=pipeline_vision(settings))
    if problem:
        raise MaterialsError(f"materials.teacher = {source!r}: {problem}. Point it at an LLaDA-Image pipeline "
                             "(model_index.json, text_encoder/, queryformer/, text_projection/, tokenizer/).")
    try:
        if not layout.remote_code_files(layout.encoder_config(folder)):
            raise layout.LayoutError(f"{folder / layout.TEXT_ENCODER_DIR}/config.json has no auto_map naming the "
                                     "backbone's modeling code. Restore the pipeline's text_encoder/ folder as "
                                     "published")
        code = layout.folder_code_closure(folder)
    except layout.LayoutError as exc:
        raise MaterialsError(f"materials.teacher = {source!r}: {exc}.") from None
    hashes = layout.remote_code_hashes(folder, code)
    if not settings.materials.trust_remote_code:
        raise MaterialsError(layout.remote_code_refusal(source, where, hashes))
    for file in sorted(folder.glob("*/*" + WEIGHTS_SUFFIX)):  # headers only: a truncated file fails here
        try:
            safetensors_header(file)
        except ValueError as exc:
            raise MaterialsError(f"materials.teacher = {source!r}: {exc}. Copy or download that file again "
                                 "(a hub download is checked and fetched again by `gguf-trainer run`).") from None
    if preflight:
        _refuse_pipeline_problem(source, folder, settings, where=where)
    return hashes


def _refuse_pipeline_problem(source: str, folder: Path, settings: Settings, *, where: str,
                             header_of: teacher_preflight.HeaderOf | None = None) -> None:
    """lib/materials/teacher_preflight.py's checks, as the materials step's refusal."""
    try:
        problem = teacher_preflight.pipeline_problem(folder, settings, header_of=header_of)
    except ValueError as exc:  # a weights header that does not read
        problem = str(exc)
    if problem:
        raise MaterialsError(f"materials.teacher = {source!r} ({where}): {problem}. Nothing of its weights was "
                             "loaded.")


def _selection_key(role: str, settings: Settings) -> str:
    """What decides which files of a repo are fetched; a snapshot made under another key is topped up.
    (The teacher's kind and vision part enter only when they differ from the default: older snapshots stay.)"""
    m = settings.materials
    key = [role, m.query_rows_file if role == "teacher" else None, m.trust_remote_code]
    if role == "teacher" and (m.teacher_kind != layout.AUTO or not pipeline_vision(settings)):
        key.append([m.teacher_kind, pipeline_vision(settings)])
    return atomic.fingerprint(key)


def _select_model_files(role: str, source: str, listing: hub.Listing, settings: Settings,
                        *, needs_query_rows: bool) -> tuple[list[str], list[str]]:
    """(small files, weight files) of a model repo; refuses what cannot be used before any download."""
    top = [p for p in listing.files if "/" not in p]
    query_rows = settings.materials.query_rows_file
    weights = _model_weights(
        role, source, top, settings,
        pickles_fix="Use a repo or revision with *.safetensors weights, or convert them and point at the local folder.",
        none_fix=f"the repo has no *.safetensors weights at its top level (files: "
                 f"{', '.join(sorted(listing.files)[:8]) or 'none'}). Point it at a transformers model repo.")
    meta = sorted(p for p in top if p.endswith(MODEL_META_SUFFIXES))
    if "config.json" not in listing.files:
        raise MaterialsError(f"materials.{role} = {source!r}: the repo has no config.json; point it at a "
                             "transformers model repo (config, tokenizer and *.safetensors).")
    if needs_query_rows:
        if query_rows not in listing.files:
            candidates = sorted(p for p in listing.files if p.endswith(WEIGHTS_SUFFIX))
            raise MaterialsError(f"materials.query_rows_file = {query_rows!r} is not in the teacher repo {source!r} "
                                 f"at {listing.commit[:12]}. Its safetensors files: {', '.join(candidates) or 'none'}. "
                                 "Set materials.query_rows_file (and query_rows_tensor) to the file holding the "
                                 "Q x hidden_size query rows.")
        meta.append(query_rows)
    return meta, weights


def _refine_model_files(role: str, source: str, folder: Path, listing: hub.Listing, settings: Settings,
                        weights: list[str]) -> tuple[list[str], list[str]]:
    """After the small files are in: refuse remote code, and fetch only the shards the index names."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    extra: list[str] = []
    if config.get("auto_map"):
        if not settings.materials.trust_remote_code:
            raise MaterialsError(f"materials.{role} = {source!r} needs remote code (config.json has auto_map). It "
                                 "is refused by default; set materials.trust_remote_code: true only if you trust it.")
        extra = sorted(p for p in listing.files if "/" not in p and p.endswith(REMOTE_CODE_SUFFIX))
    if (folder / WEIGHTS_INDEX).is_file():
        named = sorted(set(json.loads((folder / WEIGHTS_INDEX).read_text(encoding="utf-8"))["weight_map"].values()))
        missing = [p for p in named if p not in listing.files]
        if missing:
            raise MaterialsError(f"materials.{role} = {source!r}: {WEIGHTS_INDEX} names shards the repo does not "
                                 f"have ({', '.join(missing[:4])}). Pin a revision whose upload is complete.")
        weights = named
    return extra, weights


def _select_dataset_files(source: str, listing: hub.Listing) -> list[str]:
    files = sorted(p for p in listing.files if p.endswith(PROMPT_FILE_SUFFIXES)
                   and p.rsplit("/", 1)[-1] not in DATASET_METADATA_FILES)
    if not files:
        raise MaterialsError(f"materials.datasets: {source!r} has no data files ({', '.join(PROMPT_FILE_SUFFIXES)}) at "
                             f"{listing.commit[:12]}; its files: {', '.join(sorted(listing.files)[:8]) or 'none'}.")
    return files


def _select_tokenizer_files(source: str, listing: hub.Listing) -> list[str]:
    """The tokenizer files of a repo (its top level), for a GGUF student: no weights are fetched."""
    files = sorted(p for p in listing.files if p in gguf_student.TOKENIZER_FILES)
    if gguf_student.TOKENIZER_FILE not in files:
        raise MaterialsError(f"materials.{TOKENIZER_ROLE} = {source!r}: the repo has no "
                             f"{gguf_student.TOKENIZER_FILE} at its top level at {listing.commit[:12]} (files: "
                             f"{', '.join(sorted(listing.files)[:8]) or 'none'}); point it at the repo of the "
                             "model the GGUF student was exported from.")
    return files


def _resolve_hub(role: str, source: str, paths: ProjectPaths, settings: Settings, cache: dict, *,
                 pinned: str | None, text_field: str | None, token: str | None,
                 options: hub.HubOptions) -> tuple[Material, dict, dict]:
    ref = hub.RepoRef.parse(source, kind="dataset" if role == "datasets" else "model")
    root = paths.materials_dir / hub.HUB_DIR
    selection = _selection_key(role, settings)
    label = f"materials.{role} = {source!r}"
    report = {"source": source, "network": False, "downloaded_bytes": 0, "seconds": 0.0, "refetched": 0}
    checked_before_weights = False  # a pipeline's checks before its weights (teacher_preflight) ran here
    try:
        recorded = hub.read_record(root, ref, pinned) if pinned and \
            hub.record_selection(root, ref, pinned) == selection else None
        if recorded is not None and _holds_its_code(hub.snapshot_dir(root, ref, pinned), recorded):
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
                meta, weights = [], _select_dataset_files(source, full)
            elif role == TOKENIZER_ROLE:
                meta, weights = _select_tokenizer_files(source, full), []
            else:
                meta, weights = _select_model_files(role, source, full, settings, needs_query_rows=needs_query_rows)
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
                extra, weights = _refine_pipeline_files(source, folder, full, weights, fetch)
                meta += extra
                if not settings.materials.trust_remote_code:
                    raise MaterialsError(layout.remote_code_refusal(source, f"at commit {full.commit}",
                                                                    layout.remote_code_hashes(folder, extra)))
                # Everything that can fail without the weights fails now: their headers are read by range.
                _refuse_pipeline_problem(source, folder, settings, where=f"at commit {full.commit}",
                                         header_of=hub_shapes.range_headers(
                                             ref, full, folder / hub.HF_CACHE_DIR / "headers", token=token,
                                             options=options))
                checked_before_weights = True
            elif role not in ("datasets", TOKENIZER_ROLE):
                extra, weights = _refine_model_files(role, source, folder, full, settings, weights)
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
    kind, remote_code = _check_folder(role, source, folder, settings, where=f"at commit {listing.commit}",
                                      preflight=not checked_before_weights)
    material = Material(role, source, str(folder), listing.commit, len(listing.files), listing.total_bytes,
                        text_field, origin="hub", kind=kind, remote_code=remote_code)
    return material, {str(folder): verified}, report


def _holds_its_code(folder: Path, listing: hub.Listing) -> bool:
    """Whether a pipeline snapshot holds its text encoder's whole code closure (one made before the closure was
    followed has only auto_map's files: it is listed again and topped up, its files kept). True for other repos."""
    if f"{layout.TEXT_ENCODER_DIR}/config.json" not in listing.files or not folder.is_dir():
        return True
    try:
        layout.folder_code_closure(folder, listed=listing.files)
    except (layout.LayoutError, OSError, ValueError):
        return False
    return True


def _refine_pipeline_files(source: str, folder: Path, listing: hub.Listing, weights: list[str],
                           fetch) -> tuple[list[str], list[str]]:
    """After a pipeline's small files are in: its code closure, fetched here (``fetch``) file by file as the
    imports are followed, before any weight (the caller refuses it unless allowed), and only the text encoder's
    shards that its index names."""
    label = f"materials.teacher = {source!r}"
    try:
        code = layout.remote_code_closure(layout.remote_code_files(layout.encoder_config(folder)),
                                          exists=lambda p: p in listing.files, fetch=fetch,
                                          read_text=lambda p: (folder / p).read_text(encoding="utf-8"))
    except layout.LayoutError as exc:
        raise MaterialsError(f"{label}: {exc} (at commit {listing.commit[:12]}).") from None
    index = folder / layout.TEXT_ENCODER_DIR / WEIGHTS_INDEX
    if index.is_file():
        named = sorted({f"{layout.TEXT_ENCODER_DIR}/{name}" for name in
                        json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
        absent = [p for p in named if p not in listing.files]
        if absent:
            raise MaterialsError(f"{label}: text_encoder/{WEIGHTS_INDEX} names shards the repo does not have "
                                 f"({', '.join(absent[:4])}). Pin a revision whose upload is complete.")
        weights = [w for w in weights if not w.startswith(layout.TEXT_ENCODER_DIR + "/")] + named
    return code, weights


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
    _check_model_folder("student", source, folder, settings)
    _, files, size, new_folder_cache = _hash_local_folder(folder, folder_cache)
    commit = "local:" + atomic.fingerprint([record["sha256"], tok.commit, gguf_student.CONVERTER_VERSION])
    material = Material("student", source, str(folder), commit, files, size)
    extra = {"path": str(local), "file": record, "tokenizer": tok.entry()}
    reports = [{"role": TOKENIZER_ROLE, **report}] if report else []
    return material, {**tok_cache, str(folder): new_folder_cache}, reports, extra


def _unchanged_folder(folder: Path, files: dict) -> bool:
    """Whether ``folder`` holds exactly the files ``files`` recorded, with that content (by stamp, else sha256)."""
    current = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
               if p.is_file() and not p.name.startswith(atomic.TEMP_PREFIX)}
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
        _check_query_rows(Path(manifest.teacher["path"]), settings)
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
        current = _folder_files(root, _pipeline_reads(settings) if pipeline and folder == teacher["path"] else None)
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


def _check_query_rows(teacher: Path, settings: Settings) -> None:
    from safetensors import safe_open

    m = settings.materials
    file = teacher / m.query_rows_file
    hidden = json.loads((teacher / "config.json").read_text(encoding="utf-8")).get("hidden_size")
    if not file.is_file():
        raise MaterialsError(f"materials.query_rows_file = {m.query_rows_file!r}: not found in the teacher folder "
                             f"{teacher}. The teacher needs its Q x {hidden} query rows tensor.")
    with safe_open(str(file), "pt") as fh:
        names = list(fh.keys())
        if m.query_rows_tensor not in names:
            fitting = [n for n in names if fh.get_slice(n).get_shape()[-1:] == [hidden]]
            raise MaterialsError(f"materials.query_rows_tensor = {m.query_rows_tensor!r} is not in {file}. "
                                 f"Tensors of width {hidden}: {fitting or 'none'}.")
        shape = fh.get_slice(m.query_rows_tensor).get_shape()
    if len(shape) != 2 or shape[1] != hidden:
        raise MaterialsError(f"{file}:{m.query_rows_tensor} has shape {shape}, but the teacher's hidden size is "
                             f"{hidden}; the query rows must be Q x {hidden}.")


def load_manifest(paths: ProjectPaths) -> MaterialsManifest:
    """The materials manifest, with absolute paths for this project folder wherever it is now."""
    stored = read_record(paths.materials_manifest)  # DamagedRecord names the file when it cannot be read
    if stored is None:
        raise MaterialsError(f"{paths.materials_manifest} is missing: materialize the materials asset first.")
    manifest = MaterialsManifest.read(paths.materials_manifest, paths.located_doc(stored))
    manifest.hash_cache = {str(paths.located(folder)): files for folder, files in stored.get("_hash_cache", {}).items()}
    return manifest
