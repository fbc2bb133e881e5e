"""Materials: teacher, student, prompt datasets and the optional vision encoder.

Each source is a local folder or a hub repo id (optionally ``@revision``). Every resolved
source is pinned: a hub download to the commit it resolved to, a local folder to a content
hash of its files. Downstream fingerprints use that pin, so an edited teacher folder makes
its targets stale instead of being silently reused.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf_assets.lib import atomic
from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

MODEL_ROLES = ("teacher", "student", "vision_encoder")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class MaterialsError(RuntimeError):
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

    def pin(self) -> dict:
        """What downstream fingerprints depend on: the source and the exact content."""
        return {"source": self.source, "commit": self.commit}


def _hash_local_folder(folder: Path, cache: dict) -> tuple[str, int, int, dict]:
    """Content hash of a folder; file hashes are cached by (size, mtime) between runs."""
    entries, new_cache, total = [], {}, 0
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(atomic.TEMP_PREFIX))
    for file in files:
        rel = file.relative_to(folder).as_posix()
        stat = file.stat()
        key = f"{stat.st_size}:{stat.st_mtime_ns}"
        cached = cache.get(rel)
        digest = cached["sha256"] if cached and cached.get("key") == key else atomic.sha256_file(file)
        new_cache[rel] = {"key": key, "sha256": digest}
        entries.append((rel, digest))
        total += stat.st_size
    return "local:" + atomic.fingerprint(entries), len(files), total, new_cache


def _check_model_folder(role: str, source: str, folder: Path, settings: Settings) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MaterialsError(f"materials.{role} = {source!r}: {folder} has no config.json; point it at a "
                             "transformers model folder (config, tokenizer and *.safetensors).")
    weights = list(folder.glob("*.safetensors"))
    if not weights:
        pickles = list(folder.glob("*.bin")) + list(folder.glob("*.pt")) + list(folder.glob("*.pth"))
        hint = (" It has only pickle weights, which are refused because loading them can run code; "
                "convert them to safetensors first.") if pickles else ""
        raise MaterialsError(f"materials.{role} = {source!r}: no *.safetensors weights in {folder}.{hint}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("auto_map") and not settings.materials.trust_remote_code:
        raise MaterialsError(f"materials.{role} = {source!r} needs remote code (config.json has auto_map). "
                             "It is refused by default; set materials.trust_remote_code: true only if you trust it.")


def _resolve(role: str, source: str, paths: ProjectPaths, settings: Settings, cache: dict,
             *, text_field: str | None = None) -> tuple[Material, dict]:
    local = paths.resolve_local(source)
    if local.exists():
        if role in MODEL_ROLES:
            _check_model_folder(role, source, local, settings)
        commit, files, size, new_cache = _hash_local_folder(local if local.is_dir() else local.parent,
                                                            cache.get(str(local), {}))
        return Material(role, source, str(local), commit, files, size, text_field), {str(local): new_cache}
    if REPO_ID.match(source):
        raise MaterialsError(f"materials.{role} = {source!r} is not a local folder, and downloading hub repos is "
                             "not available in this version yet. Download it yourself and set the folder path.")
    raise MaterialsError(f"materials.{role} = {source!r}: no such folder ({local}) and not a hub repo id "
                         "(owner/name, optionally @revision).")


def resolve_materials(paths: ProjectPaths, settings: Settings) -> dict:
    """Resolve and pin every configured source; write materials/manifest.json; return it."""
    old = atomic.read_json(paths.materials_manifest) if paths.materials_manifest.is_file() else {}
    cache = old.get("_hash_cache", {})
    new_cache: dict = {}
    manifest: dict = {"teacher": None, "student": None, "vision_encoder": None, "datasets": []}
    m = settings.materials
    needs_teacher = settings.precompute.mode != "student" and not settings.precompute.mock_teacher
    for role in MODEL_ROLES:
        source = getattr(m, role)
        if not source or (role == "teacher" and not needs_teacher and not paths.resolve_local(source).exists()):
            continue
        material, c = _resolve(role, source, paths, settings, cache)
        manifest[role] = asdict(material)
        new_cache.update(c)
    for ds in settings.dataset_sources():
        material, c = _resolve("datasets", ds.source, paths, settings, cache, text_field=ds.text_field)
        manifest["datasets"].append(asdict(material))
        new_cache.update(c)
    if manifest["teacher"] and needs_teacher:
        _check_query_rows(Path(manifest["teacher"]["path"]), settings)
    manifest["_hash_cache"] = new_cache
    manifest["settings"] = materials_settings_key(settings)
    atomic.write_json(paths.materials_manifest, manifest)
    return manifest


def materials_settings_key(settings: Settings) -> dict:
    """The settings a materials manifest was resolved under."""
    return {**settings.section_dict("materials"), "mode": settings.precompute.mode,
            "mock_teacher": settings.precompute.mock_teacher}


def manifest_is_current(paths: ProjectPaths, settings: Settings) -> bool:
    """True if the manifest was made under these settings and no local source changed on disk."""
    if not paths.materials_manifest.is_file():
        return False
    manifest = atomic.read_json(paths.materials_manifest)
    if manifest.get("settings") != materials_settings_key(settings):
        return False
    for folder, files in manifest.get("_hash_cache", {}).items():
        root = Path(folder)
        current = {p.relative_to(root).as_posix(): p for p in root.rglob("*")
                   if p.is_file() and not p.name.startswith(atomic.TEMP_PREFIX)} if root.is_dir() else {}
        if set(current) != set(files):
            return False
        for rel, entry in files.items():
            stat = current[rel].stat()
            if entry.get("key") != f"{stat.st_size}:{stat.st_mtime_ns}":
                return False
    return True


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


def load_manifest(paths: ProjectPaths) -> dict:
    if not paths.materials_manifest.is_file():
        raise MaterialsError(f"{paths.materials_manifest} is missing: materialize the materials asset first.")
    return atomic.read_json(paths.materials_manifest)


def pins(manifest: dict, role: str) -> dict | None:
    entry = manifest.get(role)
    return None if entry is None else {"source": entry["source"], "commit": entry["commit"]}
