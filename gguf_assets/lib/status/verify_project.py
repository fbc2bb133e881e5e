"""`gguf-trainer verify`: every file a project would reuse or has delivered, re-read against its recorded hash.

`status` trusts a file whose size, mtime and inode match its record (lib/core/verify.py), which is
what keeps it fast; silent corruption with the stamp intact (a flipped bit, a restored mtime) passes
that. This reads every byte regardless of stamps: the materials (against their sha256, or the hub's
etag), the corpus splits and the local prompt files, every shard half, every checkpoint, the final
weights, and the exported GGUF files with their copies.

``repair`` marks what was found so that the next `gguf-trainer run` redoes exactly that: a file the
project made is moved aside (``<name>.damaged``, kept for a look), so its stage finds it missing;
a file of the user's (a local model or prompt file) is the user's to fix, so only its record's stamp
is dropped, and the next run hashes it again and sees the new content.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.materials import hub
from gguf_assets.lib.output.export_run import delivered_file, gguf_path
from gguf_assets.lib.precompute.shards_run import HALVES, data_file
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    FINAL_DIR,
    KEPT_DIR,
    KEPT_FILE,
    META_FILE,
    SPLITS,
    STEP_DIR,
    ProjectPaths,
)
from gguf_assets.lib.project.manifests import DamagedRecord, read_record
from gguf_assets.lib.project.settings import Settings

DAMAGED_SUFFIX = ".damaged"
class Check(StrEnum):
    """What `verify` found of one file (a str: printed as its value)."""

    OK = "ok"
    DAMAGED = "damaged"
    MISSING = "missing"


OK, DAMAGED, MISSING = Check.OK, Check.DAMAGED, Check.MISSING


@dataclass(frozen=True)
class Recorded:
    """One file with the hash its record holds. ``record`` is the JSON file that holds it, ``owner`` is
    "project" (made here: moved aside on repair) or "yours" (a source: only its stamp is forgotten)."""

    stage: str
    path: Path
    hash_kind: str  # "sha256" or "etag" (a hub checksum: sha256 for LFS files, else a git blob id)
    expected: str
    record: Path
    owner: str = "project"


@dataclass(frozen=True)
class FileCheck:
    file: Recorded
    state: Check
    bytes: int = 0


def recorded_files(paths: ProjectPaths, settings: Settings) -> Iterator[Recorded]:
    """Every file with a recorded hash, stage by stage in pipeline order. A record that cannot be read is
    the stage's damage, which `status` reports; here it yields nothing."""
    yield from _materials(paths)
    yield from _corpus(paths)
    for split in SPLITS:
        yield from _shards(paths, split)
    yield from _checkpoints(paths)
    yield from _exported(paths, settings)


def _doc(record: Path) -> dict:
    try:
        return read_record(record) or {}
    except (DamagedRecord, OSError):
        return {}


def _materials(paths: ProjectPaths) -> Iterator[Recorded]:
    record = paths.materials_manifest
    rows = _doc(record).get("query_rows") or {}
    if rows.get("path") and (rows.get("stored") or {}).get("sha256"):  # materials.query_rows, fetched by range
        yield Recorded("materials", paths.located(rows["path"]), "sha256", rows["stored"]["sha256"], record, "project")
    for folder, files in _doc(record).get("_hash_cache", {}).items():
        root = paths.located(folder)
        hub_download = root.is_relative_to(paths.materials_dir / "hub")
        for rel, entry in sorted(files.items()):
            etag = hub.recorded_etag(entry)
            if etag:
                yield Recorded("materials", root / rel, "etag", etag, record, "project" if hub_download else "yours")
            elif entry.get("sha256"):
                yield Recorded("materials", root / rel, "sha256", entry["sha256"], record,
                               "project" if hub_download else "yours")


def _corpus(paths: ProjectPaths) -> Iterator[Recorded]:
    record = paths.corpus_manifest
    doc = _doc(record)
    for split in SPLITS:
        entry = doc.get("splits", {}).get(split) or {}
        if entry.get("sha256"):
            yield Recorded("corpus", paths.corpus_file(split), "sha256", entry["sha256"], record)
    for source in doc.get("sources", []):
        file = paths.located(source["file"])
        # A dataset file under materials/ is checked with the materials; a local prompt file is the user's.
        if source.get("sha256") and not file.is_relative_to(paths.materials_dir):
            yield Recorded("corpus", file, "sha256", source["sha256"], record, "yours")


def _shards(paths: ProjectPaths, split: str) -> Iterator[Recorded]:
    for folder in sorted((paths.root / "shards" / split).glob("*")):
        for half in HALVES:
            record = folder / f"{half}.json"
            sha256 = _doc(record).get("sha256")
            if sha256:
                yield Recorded(f"{split}_shards", data_file(folder, half), "sha256", sha256, record)


def _checkpoints(paths: ProjectPaths) -> Iterator[Recorded]:
    for run_dir in sorted((paths.root / "checkpoints").glob("*")):
        if not run_dir.is_dir():
            continue
        folders = sorted(p for p in run_dir.iterdir() if STEP_DIR.match(p.name)) + [run_dir / BEST_DIR,
                                                                                    run_dir / FINAL_DIR]
        for folder in folders:
            meta = folder / META_FILE
            stage = "adapter" if folder.name == FINAL_DIR else "checkpoints"
            for name, sha256 in sorted((_doc(meta).get("sha256") or {}).items()):
                yield Recorded(stage, folder / name, "sha256", sha256, meta)
        kept = run_dir / KEPT_DIR / KEPT_FILE  # the run's own GGUF, which `gguf-trainer runs --use` puts back
        gguf = _doc(kept).get("gguf") or {}
        if gguf.get("sha256") and gguf.get("file"):
            yield Recorded("checkpoints", run_dir / KEPT_DIR / Path(gguf["file"]).name, "sha256", gguf["sha256"], kept)


def _exported(paths: ProjectPaths, settings: Settings) -> Iterator[Recorded]:
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    doc = _doc(sidecar)
    files = doc.get("files") or ([{"path": doc["path"], "sha256": doc["sha256"]}] if doc.get("sha256") else [])
    for entry in files:  # confined to the output folder and output.also_copy_to (RecordPathError names the sidecar)
        yield Recorded("gguf", delivered_file(paths, settings, entry["path"], record=sidecar), "sha256",
                       entry["sha256"], sidecar)


def check(file: Recorded) -> FileCheck:
    """Read ``file`` in full and compare it with its record."""
    try:
        size = file.path.stat().st_size
        if file.hash_kind == "etag":
            intact = hub.matches_etag(file.path, file.expected)
        else:
            intact = atomic.sha256_file(file.path) == file.expected
    except FileNotFoundError:
        return FileCheck(file, MISSING)
    except OSError:
        return FileCheck(file, DAMAGED)
    return FileCheck(file, OK if intact else DAMAGED, size)


def verify_project(paths: ProjectPaths, settings: Settings, *,
                   on_progress: Callable[[int, int, int], None] | None = None) -> list[FileCheck]:
    """Check every recorded file; ``on_progress(files_done, files_total, bytes_done)`` after each."""
    files = list(recorded_files(paths, settings))
    results, done_bytes = [], 0
    for i, file in enumerate(files, 1):
        results.append(check(file))
        done_bytes += results[-1].bytes
        if on_progress is not None:
            on_progress(i, len(files), done_bytes)
    return results


def repair(paths: ProjectPaths, results: list[FileCheck]) -> list[str]:
    """Mark every damaged or missing file so the next run redoes exactly what depends on it; what was done."""
    done = []
    for result in results:
        if result.state == OK:
            continue
        file = result.file
        shown = paths.stored(file.path)
        if file.owner == "yours":
            _forget_stamp(paths, file)
            done.append(f"{shown}: yours to restore; its record's stamp is dropped, so the next run hashes it "
                        "again and redoes what it feeds")
        elif result.state == DAMAGED:
            aside = file.path.with_name(file.path.name + DAMAGED_SUFFIX)
            os.replace(file.path, aside)
            atomic.fsync_dir(file.path.parent)
            done.append(f"{shown}: moved to {aside.name}; the next run makes it again")
        elif file.path.parent.is_dir() and file.record.is_file() and file.record.parent == file.path.parent:
            file.record.unlink()  # a checkpoint or shard whose file is gone: its record goes too
            done.append(f"{shown}: missing; its record {paths.stored(file.record)} is dropped")
        else:
            done.append(f"{shown}: missing; the next run makes it again")
    return done


def _forget_stamp(paths: ProjectPaths, file: Recorded) -> None:
    """Drop the stamp of ``file`` from the record that holds it: the next check has to read its content."""
    doc = _doc(file.record)

    def drop(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if k not in ("bytes", "mtime_ns", "inode", "key")}

    for folder, files in doc.get("_hash_cache", {}).items():
        for rel, entry in files.items():
            if paths.located(folder) / rel == file.path:
                files[rel] = drop(entry)
    if "sources" in doc:
        doc["sources"] = [{**s, "stamp": {}} if paths.located(s["file"]) == file.path else s for s in doc["sources"]]
    atomic.write_json(file.record, doc)


def summary_line(results: list[FileCheck], seconds: float) -> str:
    counts = {state: sum(1 for r in results if r.state == state) for state in (OK, DAMAGED, MISSING)}
    total = sum(r.bytes for r in results)
    return (f"verify: {len(results)} files, {total / 1e6:.1f} MB read in {seconds:.1f} s: "
            f"{counts[OK]} ok, {counts[DAMAGED]} damaged, {counts[MISSING]} missing")


def timed_verify(paths: ProjectPaths, settings: Settings, **kwargs) -> tuple[list[FileCheck], float]:
    start = time.perf_counter()
    return verify_project(paths, settings, **kwargs), time.perf_counter() - start
