"""A model folder refused before anything loads it, each refusal naming the setting and the fix: weights that
transformers would not load (pickles, none, an unknown name), a truncated safetensors file, remote code not
allowed, a tokenizer larger than the embedding table, a student ggk would run otherwise than transformers, an
LLaDA-Image pipeline with a part missing, and a teacher without its query rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf_assets.lib.core.ggk_contract import LLADA_IMAGE
from gguf_assets.lib.core.safetensors_io import safetensors_header
from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem
from gguf_assets.lib.materials.materials_run import MaterialsError, pipeline_vision
from gguf_assets.lib.materials.student.contract import student_contract_problem
from gguf_assets.lib.materials.teacher import layout
from gguf_assets.lib.materials.teacher import preflight as teacher_preflight
from gguf_assets.lib.project.manifests import MODEL_ROLES
from gguf_assets.lib.project.settings import Settings

WEIGHTS_SUFFIX = ".safetensors"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def model_weights(role: str, source: str, names: list[str], settings: Settings, *, pickles_fix: str,
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


def check_model_folder(role: str, source: str, folder: Path, settings: Settings) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MaterialsError(f"materials.{role} = {source!r}: {folder} has no config.json; point it at a "
                             "transformers model folder (config, tokenizer and *.safetensors).")
    weights = [folder / name for name in model_weights(
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


def check_folder(role: str, source: str, folder: Path, settings: Settings, *, where: str,
                 preflight: bool = True) -> tuple[str | None, dict | None]:
    """Check a resolved model folder before anything loads it; (the teacher's kind, its remote code hashes).
    ``preflight`` False: a pipeline's checks before its weights ran already (a hub download)."""
    if role not in MODEL_ROLES:
        return None, None
    if role != "teacher" or not folder.is_dir():
        check_model_folder(role, source, folder, settings)
        return None, None
    kind = layout.teacher_kind(settings.materials.teacher_kind, layout.folder_files(folder))
    if kind == layout.QUERY_ROWS:
        check_model_folder(role, source, folder, settings)
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
        refuse_pipeline_problem(source, folder, settings, where=where)
    return hashes


def refuse_pipeline_problem(source: str, folder: Path, settings: Settings, *, where: str,
                            header_of: teacher_preflight.HeaderOf | None = None) -> None:
    """lib/materials/teacher/preflight.py's checks, as the materials step's refusal."""
    try:
        problem = teacher_preflight.pipeline_problem(folder, settings, header_of=header_of)
    except ValueError as exc:  # a weights header that does not read
        problem = str(exc)
    if problem:
        raise MaterialsError(f"materials.teacher = {source!r} ({where}): {problem}. Nothing of its weights was "
                             "loaded.")


def check_query_rows_file(teacher: Path, settings: Settings) -> None:
    """The teacher's own query rows (materials.query_rows_file in its folder): there, and a Q x hidden_size tensor."""
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
