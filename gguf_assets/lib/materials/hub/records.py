"""What the hub announced and what is on disk: repo refs, listings, snapshot records, verification, disk and orphans.

Nothing here talks to the network; everything the rest of the package (and the materials stage) builds on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core import verify as stamps
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials.hub.hf_private import HF_CACHE_DIR, partial_etag, partial_files

HUB_DIR = "hub"
RECORD_SUFFIX = ".json"
DEFAULT_ENDPOINT = "https://huggingface.co"
REPO_KINDS = ("model", "dataset")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubFailure(StrEnum):
    """Why a hub call failed: the kinds a child process answers with (``ChildAnswer.kind``), and the caller's own
    two (CORRUPT, SETTING). ``_fail`` words each for the user."""

    NOT_FOUND = "not_found"  # no such repo (or private, and no token that can read it)
    GATED = "gated"  # gated, and the token (if any) has no access
    UNAUTHORIZED = "unauthorized"  # HTTP 401: the token was rejected
    FORBIDDEN = "forbidden"  # HTTP 403: the token may not read the repo
    REVISION = "revision"  # no such branch, tag or commit
    ENTRY = "entry"  # a listed file is missing on the server (404)
    HTTP = "http"  # another 4xx answer
    OFFLINE = "offline"  # HF_HUB_OFFLINE is set
    UNREACHABLE = "unreachable"  # no name resolution or nothing listening: retrying won't help
    TRANSIENT = "transient"  # a dropped connection, a 5xx or 429, a child that died: worth a retry
    STALLED = "stalled"  # the hub stopped sending (or answering) for the stall or api timeout
    SILENT = "silent"  # the hub answered nothing at all for the answer bound
    CORRUPT = "corrupt"  # the caller's: files kept arriving with another checksum than announced
    SETTING = "setting"  # the caller's: GGUF_ASSETS_HUB_ANSWER_TIMEOUT_S is no number of seconds
    NO_RANGE = "no_range"  # a Range request answered with the whole file (200): refused, not followed


TRANSIENT_KINDS = (HubFailure.TRANSIENT, HubFailure.STALLED, HubFailure.SILENT)


class HubError(UserError, RuntimeError):
    """A hub request that failed for good; ``kind`` says why, the message names the repo and the fix."""

    def __init__(self, kind: HubFailure, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def host() -> str:
    """The hub's host[:port], as the console names it."""
    return urlsplit(endpoint()).netloc or endpoint()


def is_repo_source(source: str) -> bool:
    """Whether a materials source is written as a hub repo id (owner/name, optionally @revision)."""
    repo_id, at, revision = source.partition("@")
    return bool(REPO_ID.match(repo_id)) and (not at or bool(re.fullmatch(r"[\w./-]+", revision)))


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    kind: str
    revision: str | None = None

    @classmethod
    def parse(cls, source: str, *, kind: str) -> "RepoRef":
        repo_id, at, revision = source.partition("@")
        if kind not in REPO_KINDS or not REPO_ID.match(repo_id) or (at and not revision):
            raise ValueError(f"{source!r} is not a hub {kind} id (owner/name, optionally @revision)")
        return cls(repo_id, kind, revision or None)

    @property
    def folder(self) -> str:
        return f"{self.kind}s/{self.repo_id.replace('/', '--')}"

    @property
    def web_url(self) -> str:
        prefix = "datasets/" if self.kind == "dataset" else ""
        return f"{endpoint()}/{prefix}{self.repo_id}"

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    blob_id: str
    sha256: str | None = None  # set for LFS files

    @property
    def etag(self) -> str:
        """What the hub sends as ETag, hence what huggingface_hub names partial files by."""
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class Listing:
    commit: str
    files: dict[str, RemoteFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def subset(self, paths: list[str]) -> "Listing":
        return Listing(self.commit, {p: self.files[p] for p in paths})


def snapshot_dir(root: Path, ref: RepoRef, commit: str) -> Path:
    return root / ref.folder / commit


def record_path(root: Path, ref: RepoRef, commit: str) -> Path:
    return root / ref.folder / (commit + RECORD_SUFFIX)


def read_record(root: Path, ref: RepoRef, commit: str) -> Listing | None:
    path = record_path(root, ref, commit)
    if not path.is_file():
        return None
    data = atomic.read_json(path)
    return Listing(data["commit"], {p: RemoteFile(**f) for p, f in data["files"].items()})


def write_record(root: Path, ref: RepoRef, listing: Listing, *, selection: str) -> None:
    atomic.write_json(record_path(root, ref, listing.commit), {
        "repo_id": ref.repo_id, "kind": ref.kind, "commit": listing.commit, "selection": selection,
        "files": {p: asdict(f) for p, f in sorted(listing.files.items())}})


def record_selection(root: Path, ref: RepoRef, commit: str) -> str | None:
    path = record_path(root, ref, commit)
    return atomic.read_json(path).get("selection") if path.is_file() else None


# ---------------------------------------------------------------- verification

def git_blob_id(path: Path, *, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def matches_etag(path: Path, etag: str) -> bool:
    """The file's content against the hub's checksum: a sha256 for LFS files (64 hex digits), else a git blob id."""
    return (atomic.sha256_file(path) if len(etag) == 64 else git_blob_id(path)) == etag


def verified_entry(path: Path, etag: str) -> dict:
    """The record of a file that matched ``etag``: lib/verify's stamp plus the etag."""
    return {**stamps.stamp(path), "etag": etag}


def still_verified(path: Path, entry: dict) -> bool | None:
    """Is a recorded file still the one that matched its etag? lib/verify's rule: True or False by the
    stamp; None when it is unsure (a copied project: new inodes), which the content then settles."""
    if "key" in entry:  # recorded before stamps: "size:mtime_ns", and the etag under "verified"
        st = path.stat() if path.is_file() else None
        return st is not None and entry["key"] == f"{st.st_size}:{st.st_mtime_ns}"
    return stamps.stamp_matches(path, entry)


def recorded_etag(entry: dict) -> str | None:
    return entry.get("etag", entry.get("verified"))


def verify(folder: Path, listing: Listing, cache: dict) -> tuple[list[str], dict]:
    """Files of ``listing`` missing from ``folder`` or differing from what the hub announced.

    ``cache`` holds each file's record from an earlier check (``verified_entry``), so a file whose
    stamp still matches is not hashed again; the returned cache covers the files that passed.
    """
    bad, new_cache = [], {}
    for rel, remote in sorted(listing.files.items()):
        path = folder / rel
        if not path.is_file() or path.stat().st_size != remote.size:
            bad.append(rel)
            continue
        cached = cache.get(rel) or {}
        known = recorded_etag(cached) == remote.etag and still_verified(path, cached) is True
        if not known and not matches_etag(path, remote.etag):
            bad.append(rel)
            continue
        new_cache[rel] = verified_entry(path, remote.etag)
    return bad, new_cache


# ---------------------------------------------------------------- disk and orphans

def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_disk(folder: Path, ref: RepoRef, listing: Listing, *, reserve_bytes: int) -> int:
    """Raise before any download when the files still missing do not fit; return the bytes needed."""
    needed = 0
    for rel, remote in listing.files.items():
        path = folder / rel
        if not (path.is_file() and path.stat().st_size == remote.size):
            needed += remote.size
    free = shutil.disk_usage(_existing_parent(folder)).free
    if needed + reserve_bytes > free:
        raise HubError("disk", f"{ref}: not enough free disk for the download. It needs {needed / 2**30:.2f} GiB "
                               f"more (plus {reserve_bytes / 2**30:.2f} GiB kept free) and only {free / 2**30:.2f} "
                               f"GiB are free on the disk holding {folder}. Free some space, or move the project "
                               "folder to a bigger disk, then run again (finished files are kept).")
    return needed


def remove_orphans(folder: Path, listing: Listing) -> int:
    """Delete partial downloads that no file of ``listing`` (the whole selection) can resume from."""
    wanted = {f.etag for f in listing.files.values()}
    removed = 0
    for partial in partial_files(folder):
        if partial_etag(partial, wanted) is None:
            partial.unlink(missing_ok=True)
            removed += 1
    return removed


def has_partial(folder: Path, *, at_least: int) -> bool:
    """A partial file of ``folder`` holds ``at_least`` bytes: a download is mid-file."""
    for partial in partial_files(folder):
        with contextlib.suppress(FileNotFoundError):  # huggingface_hub renames it when the file is done
            if partial.stat().st_size >= at_least:
                return True
    return False


def finish(folder: Path, root: Path, ref: RepoRef, listing: Listing, *, selection: str) -> None:
    """Drop huggingface_hub's working files and files outside the selection; write the record last."""
    shutil.rmtree(folder / HF_CACHE_DIR, ignore_errors=True)
    for path in sorted(folder.rglob("*"), reverse=True):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in listing.files:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    write_record(root, ref, listing, selection=selection)


def remove_unfinished_snapshots(root: Path, keep: set[Path]) -> list[Path]:
    """Delete unfinished downloads of older commits of the repos in use (the revision moved on).

    A repo no longer configured keeps its partial download: switching the mock teacher on for
    a while must not throw away half of a 30 GB teacher.
    """
    removed = []
    for repo_dir in {folder.parent for folder in keep if folder.parent.parent.parent == root}:
        for snap in repo_dir.iterdir():
            if snap.is_dir() and snap not in keep and not (repo_dir / (snap.name + RECORD_SUFFIX)).is_file():
                shutil.rmtree(snap, ignore_errors=True)
                removed.append(snap)
    return removed
