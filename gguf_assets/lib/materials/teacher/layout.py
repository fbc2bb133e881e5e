"""Which kind of teacher a repo or folder holds, and which of its files the product fetches. No torch here.

Two kinds:
- ``query-rows``: a transformers LLM (config.json at the top) with a fixed Q x D matrix of query rows appended to
  every prompt (materials.query_rows_file or materials.query_rows), read at those rows.
- ``llada-image``: an LLaDA-Image pipeline folder (diffusers: ``model_index.json`` and one folder per part), whose
  conditioning is made by its text stack: ``text_encoder/`` (LLaDA2-MoE, the repo's own code), ``queryformer/``,
  ``text_projection/`` and ``tokenizer/`` (lib/precompute/llada_teacher.py). Only those are fetched, and
  ``sigvq/`` when the vision encoder is exported from it; the DiT (``transformer/``) and the VAE never are.

``materials.teacher_kind: auto`` tells them apart by what the repo holds; a setting names the kind outright.
The kind and the version of its forward are part of the targets' fingerprint (TEACHER_FORWARDS), so targets made
by a forward that was later corrected are stale, never reused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.settings import TEACHER_KINDS

AUTO, QUERY_ROWS, LLADA_IMAGE_PIPELINE = TEACHER_KINDS
# The version of each kind's forward. Raise one when its computation changes (masks, positions, rotary tables):
# every target it made becomes stale.
TEACHER_FORWARDS = {QUERY_ROWS: 1, LLADA_IMAGE_PIPELINE: 1}

MODEL_INDEX = "model_index.json"
TEXT_ENCODER_DIR = "text_encoder"
QUERYFORMER_DIR = "queryformer"
PROJECTION_DIR = "text_projection"
TOKENIZER_DIR = "tokenizer"
VISION_DIR = "sigvq"
TEXT_STACK = (TEXT_ENCODER_DIR, QUERYFORMER_DIR, PROJECTION_DIR, TOKENIZER_DIR)
SMALL_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
WEIGHTS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class LayoutError(ValueError):
    """A pipeline folder or repo that lacks what the text stack needs; the message names what and the fix."""


def is_pipeline(files: Iterable[str]) -> bool:
    """Whether these repo-relative paths are an LLaDA-Image pipeline: the index and its QueryFormer."""
    names = set(files)
    return MODEL_INDEX in names and any(f.startswith(QUERYFORMER_DIR + "/") for f in names)


def teacher_kind(setting: str, files: Iterable[str]) -> str:
    """The kind of teacher ``files`` hold under materials.teacher_kind = ``setting``."""
    if setting != AUTO:
        return setting
    return LLADA_IMAGE_PIPELINE if is_pipeline(files) else QUERY_ROWS


def is_read(path: str, *, vision: bool) -> bool:
    """Whether the teacher reads this file of a pipeline (its pin covers these, not the DiT or the VAE)."""
    return path == MODEL_INDEX or path.split("/", 1)[0] in TEXT_STACK + ((VISION_DIR,) if vision else ())


def folder_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def pipeline_selection(files: Iterable[str], *, vision: bool) -> tuple[list[str], list[str]]:
    """(small files, weight files) of a pipeline the teacher needs: the index, the text stack's configs, tokenizer
    and safetensors, and ``sigvq/`` when ``vision``. Remote code is chosen later, from the config's auto_map
    (remote_code_files); the text encoder's shards from its index, when it has one."""
    parts = TEXT_STACK + ((VISION_DIR,) if vision else ())
    names = sorted(set(files))
    inside = [f for f in names if f.split("/", 1)[0] in parts and "/" in f]
    for part in parts:
        if not any(f.startswith(part + "/") for f in inside):
            raise LayoutError(f"the pipeline has no {part}/ folder (it has: "
                              f"{', '.join(sorted({f.split('/', 1)[0] for f in names if '/' in f})) or 'none'})")
    small = [MODEL_INDEX] + [f for f in inside if f.endswith(SMALL_SUFFIXES)]
    weights = [f for f in inside if f.endswith(WEIGHTS_SUFFIX)]
    for part in parts:
        if part != TOKENIZER_DIR and not any(f.startswith(part + "/") for f in weights):
            pickles = [f for f in inside if f.startswith(part + "/") and f.endswith(PICKLE_SUFFIXES)]
            raise LayoutError(f"{part}/ has no *.safetensors weights"
                              + (f", only pickles ({', '.join(pickles[:3])}), which are refused because loading them "
                                 "can run code" if pickles else ""))
    return small, weights


def remote_code_files(config: dict) -> list[str]:
    """The text encoder's modeling files its config.json's ``auto_map`` names, as repo-relative paths (the entry
    points of its code; remote_code_closure adds what they import)."""
    modules = set()
    for target in (config.get("auto_map") or {}).values():
        for ref in ([target] if isinstance(target, str) else [t for t in target if t]):
            if "--" in ref:
                raise LayoutError(f"{TEXT_ENCODER_DIR}/config.json's auto_map names code in another repo ({ref!r}), "
                                  "which is not fetched: use a pipeline whose code is in its own text_encoder/")
            modules.add(ref.rsplit(".", 1)[0])
    return sorted(f"{TEXT_ENCODER_DIR}/{module.replace('.', '/')}.py" for module in modules)


# The relative imports a module file makes: transformers' two patterns (dynamic_module_utils.get_relative_imports:
# ``import .x`` and ``from .x import y``) and ``from . import x, y``, which names modules too.
_IMPORT_DOT = re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE)
_FROM_DOT = re.compile(r"^\s*from\s+(\.+)(\S*)\s+import\s+\(?([^)\n#]*)", re.MULTILINE)


def relative_imports(source: str, importer: str) -> list[str]:
    """The repo-relative module files that ``source`` (the file ``importer``) imports relatively, in order.

    A relative import that climbs out of the importer's folder (``from ..x``) is refused: nothing outside
    text_encoder/ is fetched or run."""
    folder = importer.rsplit("/", 1)[0]
    modules: list[str] = [m for m in _IMPORT_DOT.findall(source)]
    for dots, module, names in _FROM_DOT.findall(source):
        if len(dots) > 1:
            raise LayoutError(f"{importer} imports from outside its folder ({dots}{module}), which is not fetched "
                              "or run: use a pipeline whose text encoder code is all in text_encoder/")
        if module:
            modules.append(module)
        else:  # from . import a, b as c
            modules += [n.split(" as ")[0].strip() for n in names.split(",") if n.strip()]
    found: list[str] = []
    for module in modules:
        path = f"{folder}/{module.replace('.', '/')}.py"
        if path not in found:
            found.append(path)
    return found


def remote_code_closure(entries: list[str], *, exists: Callable[[str], bool], read_text: Callable[[str], str],
                        fetch: Callable[[list[str]], None] = lambda paths: None) -> list[str]:
    """Every module file the text encoder's code needs: ``entries`` (auto_map's files) and, recursively, what each
    imports relatively, as transformers collects them before it runs the code. ``exists``: whether the repo or
    folder has a path; ``fetch``: bring paths in before ``read_text`` reads them (a hub download; kilobytes).

    A module that is not there is refused at once, naming it and the file that imports it (transformers would
    stop only after every weight is in, with a FileNotFoundError)."""
    closure: list[str] = []
    importer = dict.fromkeys(entries, f"{TEXT_ENCODER_DIR}/config.json's auto_map")
    frontier = sorted(entries)
    while frontier:
        missing = [p for p in frontier if not exists(p)]
        if missing:
            raise LayoutError(f"{importer[missing[0]]} needs {missing[0]}, which the pipeline does not have"
                              + (f" (nor {', '.join(missing[1:])})" if missing[1:] else "")
                              + ": its text encoder code is incomplete. Use a revision whose text_encoder/ holds "
                                "every module its code imports")
        fetch(frontier)
        closure += frontier
        found: list[str] = []
        for path in frontier:
            for module in relative_imports(read_text(path), path):
                if module not in closure and module not in found:
                    found.append(module)
                    importer[module] = path
        frontier = found
    return sorted(closure)


def folder_code_closure(folder: Path, *, listed: Iterable[str] | None = None) -> list[str]:
    """remote_code_closure over a local pipeline folder (``listed``: only those of its files count, a snapshot's
    record)."""
    known = None if listed is None else set(listed)
    return remote_code_closure(remote_code_files(encoder_config(folder)),
                               exists=lambda p: (folder / p).is_file() and (known is None or p in known),
                               read_text=lambda p: (folder / p).read_text(encoding="utf-8"))


def encoder_config(folder: Path) -> dict:
    return json.loads((folder / TEXT_ENCODER_DIR / "config.json").read_text(encoding="utf-8"))


def remote_code_hashes(folder: Path, files: list[str]) -> dict[str, str]:
    """{path: sha256} of the modeling files: what the user is asked to trust, and part of the targets' fingerprint."""
    return {f: atomic.sha256_file(folder / f) for f in files}


def remote_code_refusal(source: str, where: str, hashes: dict[str, str]) -> str:
    listed = "; ".join(f"{path} (sha256 {digest})" for path, digest in hashes.items())
    return (f"materials.teacher = {source!r} is an LLaDA-Image pipeline whose text encoder runs the repo's own code, "
            f"{where}: {listed}. The product runs no repo's code unless told to. Read those files, then set "
            "materials.trust_remote_code: true in project.yaml.")


def pipeline_folder_problem(folder: Path, *, vision: bool) -> str | None:
    """What a local pipeline folder lacks for the teacher, or None."""
    try:
        small, _ = pipeline_selection(folder_files(folder), vision=vision)
    except LayoutError as exc:
        return f"{folder}: {exc}"
    for part in (TEXT_ENCODER_DIR, QUERYFORMER_DIR, PROJECTION_DIR):
        if f"{part}/config.json" not in small:
            return f"{folder}: {part}/config.json is missing"
    return None


def is_pipeline_folder(folder: Path) -> bool:
    """A pipeline folder the estimate can read: its index and its text encoder's config (weights may come later)."""
    return (folder / MODEL_INDEX).is_file() and (folder / TEXT_ENCODER_DIR / "config.json").is_file()


def part_config(folder: Path, part: str) -> dict:
    return json.loads((folder / part / "config.json").read_text(encoding="utf-8"))


def conditioning_shape(folder: Path) -> tuple[int, int]:
    """(Q, D) of the targets: the QueryFormer's queries and the text projection's width, from their configs."""
    try:
        return (int(part_config(folder, QUERYFORMER_DIR)["num_queries"]),
                int(part_config(folder, PROJECTION_DIR)["projection_dim"]))
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise LayoutError(f"{folder}: the QueryFormer's num_queries and the text projection's projection_dim are not "
                          f"readable from their config.json ({type(exc).__name__}: {exc})") from None


def parts_params(folder: Path) -> int:
    """Parameters of the QueryFormer and the text projection, from their configs (lib/precompute/llada_teacher.py
    builds exactly these modules)."""
    qf, tp = part_config(folder, QUERYFORMER_DIR), part_config(folder, PROJECTION_DIR)
    d, inter = qf["hidden_size"], qf["intermediate_size"]
    block = 3 * d * d + 3 * d + d * d + d + d * inter + inter + inter * d + d
    queryformer = qf["num_queries"] * d + qf.get("num_hidden_layers", 1) * block
    d, inter = tp["hidden_size"], tp["intermediate_size"]
    layer = 4 * (d * d + d) + d * inter + inter + inter * d + d
    return queryformer + tp.get("num_hidden_layers", 6) * layer + d * tp["projection_dim"] + tp["projection_dim"]


def index_bytes(folder: Path) -> int | None:
    """The text encoder's weights in bytes, from its safetensors index (metadata.total_size), when it has one."""
    index = folder / TEXT_ENCODER_DIR / "model.safetensors.index.json"
    if not index.is_file():
        return None
    total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
    return int(total) if isinstance(total, int | float) else None
