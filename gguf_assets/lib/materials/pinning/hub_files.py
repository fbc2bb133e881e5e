"""Which files of a hub repo the materials step fetches, and in which order: a model's small files first (config,
tokenizer, the weights' index), so that remote code and a missing shard are refused before the weights; a
pipeline's text stack and its code closure; a dataset's data files; a GGUF student's tokenizer. Each choice
refuses what cannot be used before anything big is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.materials import hub
from gguf_assets.lib.materials.materials_run import TOKENIZER_ROLE, MaterialsError, pipeline_vision
from gguf_assets.lib.materials.pinning.checks import WEIGHTS_INDEX, WEIGHTS_SUFFIX, model_weights
from gguf_assets.lib.materials.student import from_gguf as gguf_student
from gguf_assets.lib.materials.teacher import layout
from gguf_assets.lib.project.formats import PROMPT_FILE_SUFFIXES
from gguf_assets.lib.project.layout import DATASET_METADATA_FILES
from gguf_assets.lib.project.settings import Settings

# What a model needs besides its weights: config, tokenizer, generation and preprocessor configs.
MODEL_META_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
REMOTE_CODE_SUFFIX = ".py"


def selection_key(role: str, settings: Settings) -> str:
    """What decides which files of a repo are fetched; a snapshot made under another key is topped up.
    (The teacher's kind and vision part enter only when they differ from the default: older snapshots stay.)"""
    m = settings.materials
    key = [role, m.query_rows_file if role == "teacher" else None, m.trust_remote_code]
    if role == "teacher" and (m.teacher_kind != layout.AUTO or not pipeline_vision(settings)):
        key.append([m.teacher_kind, pipeline_vision(settings)])
    return atomic.fingerprint(key)


def select_model_files(role: str, source: str, listing: hub.Listing, settings: Settings,
                       *, needs_query_rows: bool) -> tuple[list[str], list[str]]:
    """(small files, weight files) of a model repo; refuses what cannot be used before any download."""
    top = [p for p in listing.files if "/" not in p]
    query_rows = settings.materials.query_rows_file
    weights = model_weights(
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


def refine_model_files(role: str, source: str, folder: Path, listing: hub.Listing, settings: Settings,
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


def select_dataset_files(source: str, listing: hub.Listing) -> list[str]:
    files = sorted(p for p in listing.files if p.endswith(PROMPT_FILE_SUFFIXES)
                   and p.rsplit("/", 1)[-1] not in DATASET_METADATA_FILES)
    if not files:
        raise MaterialsError(f"materials.datasets: {source!r} has no data files ({', '.join(PROMPT_FILE_SUFFIXES)}) at "
                             f"{listing.commit[:12]}; its files: {', '.join(sorted(listing.files)[:8]) or 'none'}.")
    return files


def select_tokenizer_files(source: str, listing: hub.Listing) -> list[str]:
    """The tokenizer files of a repo (its top level), for a GGUF student: no weights are fetched."""
    files = sorted(p for p in listing.files if p in gguf_student.TOKENIZER_FILES)
    if gguf_student.TOKENIZER_FILE not in files:
        raise MaterialsError(f"materials.{TOKENIZER_ROLE} = {source!r}: the repo has no "
                             f"{gguf_student.TOKENIZER_FILE} at its top level at {listing.commit[:12]} (files: "
                             f"{', '.join(sorted(listing.files)[:8]) or 'none'}); point it at the repo of the "
                             "model the GGUF student was exported from.")
    return files


def holds_its_code(folder: Path, listing: hub.Listing) -> bool:
    """Whether a pipeline snapshot holds its text encoder's whole code closure (one made before the closure was
    followed has only auto_map's files: it is listed again and topped up, its files kept). True for other repos."""
    if f"{layout.TEXT_ENCODER_DIR}/config.json" not in listing.files or not folder.is_dir():
        return True
    try:
        layout.folder_code_closure(folder, listed=listing.files)
    except (layout.LayoutError, OSError, ValueError):
        return False
    return True


def refine_pipeline_files(source: str, folder: Path, listing: hub.Listing, weights: list[str],
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
