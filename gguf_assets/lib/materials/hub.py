"""Hugging Face hub snapshots inside the project folder: pinned, verified, resumable.

Layout under ``<project>/materials/hub/``::

    models/<owner>--<name>/<commit>/        the needed files of the repo at that commit, as in the repo
    models/<owner>--<name>/<commit>.json    the record, written last: each file's size and the sha256
                                            (LFS files) or git blob id (small files) the hub announced
    datasets/<owner>--<name>/...            the same for dataset repos

A folder is named by the commit it holds, so a moved ``main`` upstream can never change files
under a pinned folder, and a folder with a record is complete: it is reused with no network call
while its files still match the record. During a download, ``<commit>/.cache/huggingface/`` holds
huggingface_hub's ``local_dir`` metadata and the ``*.incomplete`` partial files; a killed download
resumes from them on the next run, partial files that belong to no wanted file are deleted before
it starts, and the whole ``.cache`` folder is removed once the snapshot is verified.

Every network call runs in a child process (``python -m gguf_assets.lib.materials.hub``) watched by the
caller. huggingface_hub reads its endpoint, timeouts and the implicit-token, Xet and telemetry
switches from the environment when it is imported, and its API calls have no timeout, so only a
fresh process can be configured reliably and killed when it stalls. The token goes to the child
on stdin: never in argv, the environment, a file or a log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.core import verify as stamps
from gguf_assets.lib.core.errors import UserError

log = logging.getLogger(__name__)

HUB_DIR = "hub"
RECORD_SUFFIX = ".json"
HF_CACHE_DIR = ".cache"
INCOMPLETE_SUFFIX = ".incomplete"
DEFAULT_ENDPOINT = "https://huggingface.co"
REPO_KINDS = ("model", "dataset")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
HF_TOKEN_ENV = "HF_TOKEN"  # the only place the HF token is read from (token_from_env); never stored or shown
# Variables whose value could make the child send a token other than the one handed to it.
TOKEN_ENV_VARS = (HF_TOKEN_ENV, "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")
# The pipe on which a child says its imports are done ("r"), then each request it sends ("q") and each answer
# (response headers) it gets ("a"): the watchdog tells a hub that answers nothing from a slow one.
READY_FD_ENV = "GGUF_ASSETS_HUB_READY_FD"
# How long a hub (or mirror, or the proxy in between) may leave the requests unanswered, over all the
# tries of one listing or download, before the run gives up; an answering but slow hub is bound by the
# api and stall timeouts instead. The user's knob, named in the messages.
ANSWER_TIMEOUT_ENV = "GGUF_ASSETS_HUB_ANSWER_TIMEOUT_S"
DEFAULT_ANSWER_TIMEOUT_S = 90.0
WAITING_NOTICE_S = 5.0  # a request unanswered this long gets a console line (sooner with a small bound)
CHILD_START_S = 120.0  # a child that cannot even start in this long is killed and retried
# How "the hub cannot be reached at all" reads in the HTTP client's errors (glibc, macOS, httpx).
UNREACHABLE_SIGNS = ("Name or service not known", "Temporary failure in name resolution",
                     "nodename nor servname", "No address associated with hostname", "Connection refused",
                     "Network is unreachable", "getaddrinfo failed")


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


@dataclass(frozen=True)
class ChildAnswer:
    """What a child process (``_child_main``) answers for its one request, as one JSON line on its stdout; or what
    the watchdog (``_run_child``) concludes when the child stalls, stays silent or dies.

    ``ok``: a listing has its ``commit`` and ``files``, a download the files it finished from partial ones
    (``resumed``). Otherwise ``kind`` says why, with the HTTP ``status`` when there was one, the error's
    ``detail`` (token-free only once redacted) and, for a silent hub, the bound it had (``limit_s``)."""

    ok: bool
    kind: HubFailure | None = None
    status: int | None = None
    detail: str = ""
    limit_s: float | None = None
    commit: str | None = None
    files: tuple[RemoteFile, ...] = ()
    resumed: tuple[str, ...] = ()
    etag: str | None = None  # a range read (``fetch_range``): the file's etag and size from the hub's metadata
    size: int | None = None

    @classmethod
    def failed(cls, kind: HubFailure, detail: str, *, status: int | None = None,
               limit_s: float | None = None) -> ChildAnswer:
        return cls(ok=False, kind=kind, status=status, detail=detail, limit_s=limit_s)

    @property
    def retryable(self) -> bool:
        """A failure that another try may mend (a dropped connection, a stall, a silent hub)."""
        return not self.ok and self.kind in TRANSIENT_KINDS

    def to_json(self) -> dict:
        """{"ok": true, "commit", "files"} of a listing, {"ok": true, "resumed"} of a download, or
        {"ok": false, "kind", "status", "detail"[, "limit_s"]} of a failure."""
        if self.ok:
            if self.etag is not None:  # a range read
                return {"ok": True, "commit": self.commit, "etag": self.etag, "size": self.size}
            if self.commit is not None:
                return {"ok": True, "commit": self.commit, "files": [asdict(f) for f in self.files]}
            return {"ok": True, "resumed": list(self.resumed)}
        return {"ok": False, "kind": self.kind.value if self.kind is not None else None, "status": self.status,
                "detail": self.detail, **({"limit_s": self.limit_s} if self.limit_s is not None else {})}

    @classmethod
    def from_json(cls, data: dict) -> ChildAnswer:
        """The answer in ``data``; an unknown kind raises ValueError (the caller takes it for a broken child)."""
        if data["ok"]:
            return cls(ok=True, commit=data.get("commit"),
                       files=tuple(RemoteFile(**f) for f in data.get("files") or ()),
                       resumed=tuple(data.get("resumed") or ()), etag=data.get("etag"), size=data.get("size"))
        return cls.failed(HubFailure(data["kind"]), str(data.get("detail") or ""), status=data.get("status"),
                          limit_s=data.get("limit_s"))


def answer_timeout_from_env() -> float:
    """GGUF_ASSETS_HUB_ANSWER_TIMEOUT_S, or the default; a value that is no positive number is the user's to fix."""
    raw = os.environ.get(ANSWER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_ANSWER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise HubError(HubFailure.SETTING,
                       f"{ANSWER_TIMEOUT_ENV}={raw!r} is not a number of seconds above 0: how long to wait for a hub "
                       f"that answers nothing. Unset it (default {DEFAULT_ANSWER_TIMEOUT_S:.0f}) or set it to, for "
                       "example, 300.")
    return value


@dataclass(frozen=True)
class HubOptions:
    """Timeouts and retry bounds; tests shrink them, the defaults suit a slow home connection."""

    # A hub that answers nothing at all (no response to a request), over all the tries of one call: the
    # call gives up after this long. Each try waits a share of it (the tries: ``attempts``).
    answer_timeout_s: float = field(default_factory=answer_timeout_from_env)
    api_timeout_s: float = 120.0  # a listing call that takes longer is killed and retried
    stall_timeout_s: float = 120.0  # a download with no new byte for this long is killed and retried
    attempts: int = 4  # tries per phase (stalls, dropped connections, 5xx, corrupted files)
    retry_wait_s: float = 3.0
    disk_reserve_bytes: int = 512 << 20  # left free after a download
    max_workers: int = 4
    poll_s: float = 0.25
    # huggingface_hub writes 10 MiB chunks; smaller ones let the watchdog see progress on a slow
    # link and let a killed download keep more of what it received.
    chunk_bytes: int = 256 << 10


@dataclass
class TransferStats:
    downloaded_bytes: int = 0
    attempts: int = 0
    refetched: int = 0
    seconds: float = 0.0


def token_from_env() -> str | None:
    """The HF token the hub calls send: HF_TOKEN as it is now (read at each call, in the process that calls, so
    a process that runs several pipelines sees it as it is at each run), or None."""
    return os.environ.get(HF_TOKEN_ENV) or None


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


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

def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:  # renamed by the downloader while we walk
            pass
    return total


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


def _partial_etag(partial: Path, wanted: set[str]) -> str | None:
    """huggingface_hub names partials <hash>.<etag>[.<random>].incomplete; which wanted etag is it?"""
    return next((part for part in partial.name.split(".") if part in wanted), None)


def remove_orphans(folder: Path, listing: Listing) -> int:
    """Delete partial downloads that no file of ``listing`` (the whole selection) can resume from."""
    download_dir = folder / HF_CACHE_DIR / "huggingface" / "download"
    wanted = {f.etag for f in listing.files.values()}
    removed = 0
    for partial in download_dir.rglob("*" + INCOMPLETE_SUFFIX) if download_dir.is_dir() else ():
        if _partial_etag(partial, wanted) is None:
            partial.unlink(missing_ok=True)
            removed += 1
    return removed


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


# ---------------------------------------------------------------- the child process

def _child_env(options: HubOptions) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV_VARS}
    package_parent = str(Path(__file__).resolve().parents[3])  # the child imports this module by name
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.update({
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",  # a token in ~/.cache/huggingface is never sent
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # progress is logged by the watchdog instead
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_ETAG_TIMEOUT": str(max(1, int(options.api_timeout_s))),
        # Half the stall timeout: huggingface_hub resumes a timed-out read itself before the watchdog acts.
        "HF_HUB_DOWNLOAD_TIMEOUT": str(max(1, int(options.stall_timeout_s / 2))),
    })
    return env


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "<HF_TOKEN>") if token else text


def host() -> str:
    """The hub's host[:port], as the console names it."""
    return urlsplit(endpoint()).netloc or endpoint()


@dataclass
class Waiting:
    """How long the hub has left one listing's or download's requests unanswered, over all its tries.

    The clock starts when a request goes out while none is outstanding and stops at any answer (response
    headers, or a new byte of a download): a slow hub answers, a stalled one (or a proxy holding the
    connection) does not. Each try gets a share of ``limit_s``, so a connection that hangs is replaced
    by a new one; the call gives up once the whole of it has passed without an answer.
    """

    what: str  # "listing demo/student", for the console line
    limit_s: float
    attempts: int
    since: float | None = None  # time.monotonic() of the first unanswered request; None after an answer
    told: bool = False
    start_s: float = 0.0  # how long the last try's process took to start (it counts into the silence)

    @property
    def per_try_s(self) -> float:
        return self.limit_s / max(1, self.attempts)

    @property
    def notice_s(self) -> float:
        return min(WAITING_NOTICE_S, self.limit_s / 4)

    def began(self, at: float) -> None:
        if self.since is None:
            self.since, self.told = at, False

    def heard(self) -> None:
        self.since = None

    def silent_s(self, now: float | None = None) -> float:
        return 0.0 if self.since is None else (time.monotonic() if now is None else now) - self.since

    def pause_s(self, retry_wait_s: float) -> float:
        """The wait before the next try: while the hub is silent, short enough to leave the tries their share."""
        return retry_wait_s if self.since is None else min(retry_wait_s, self.per_try_s / 4)

    def spent(self, retry_wait_s: float, now: float | None = None) -> bool:
        """Whether a next try would have too little of the bound left to be worth starting: then the try
        under way gets the rest of it, and the call gives up once it has passed."""
        left = self.limit_s - self.silent_s(now) - self.pause_s(retry_wait_s) - self.start_s
        return self.since is not None and left < self.per_try_s / 4

    def over(self) -> bool:
        """Whether the hub has now answered nothing for the whole bound."""
        return self.since is not None and self.silent_s() >= self.limit_s

    def tell(self, now: float) -> None:
        if self.told or self.silent_s(now) < self.notice_s:
            return
        self.told = True
        clock = time.strftime("%H:%M:%S", time.localtime(time.time() - self.silent_s(now)))
        log.warning("waiting for the hub at %s to answer (%.0f s, since %s): %s; it gets %.0f s in all (%s)",
                    host(), self.silent_s(now), clock, self.what, self.limit_s, ANSWER_TIMEOUT_ENV)


def _signals(fd: int) -> bytes | None:
    """What the child said on the ready pipe since the last look; None once it closed the pipe."""
    if not select.select([fd], [], [], 0)[0]:
        return b""
    return os.read(fd, 1 << 16) or None


def _run_child(request: dict, *, token: str | None, options: HubOptions, progress_dir: Path | None,
               on_progress=None, waiting: Waiting | None = None) -> ChildAnswer:
    """Run one request in a child; kill it when it stalls. Returns the child's answer.

    Two clocks: ``limit`` (the api timeout for a listing, the stall timeout for a download: no new byte)
    bounds a hub that answers slowly; ``waiting`` bounds a hub that answers nothing at all.
    """
    # The hub's clock starts when the child is ready to ask (its imports done): on a loaded machine the
    # start alone can take longer than a short api timeout, and that is not the hub's silence.
    ready_read, ready_write = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**_child_env(options), READY_FD_ENV: str(ready_write)},
                                pass_fds=(ready_write,), text=True)
    finally:
        os.close(ready_write)
    payload = json.dumps({**request, "token": token})
    limit = options.stall_timeout_s if progress_dir is not None else options.api_timeout_s
    started = time.monotonic()
    ready, last_bytes, last_change = False, -1, started
    asked = answered = 0  # requests the child sent, and answers it got
    quiet_since = started  # this try's last sign of the hub: an answer, a byte, or a request after none pending
    pipe_open = True
    first, wait = True, 0.02  # short waits first: most calls end within a second
    try:
        while True:
            try:
                out, err = proc.communicate(input=payload if first else None, timeout=wait)
                break
            except subprocess.TimeoutExpired:
                first, wait = False, min(options.poll_s, wait * 2)
            now = time.monotonic()
            said = _signals(ready_read) if pipe_open else b""
            if said is None:
                pipe_open, said = False, b""
            if b"r" in said and not ready:
                ready, last_change, quiet_since = True, now, now
                if waiting is not None:
                    waiting.start_s = now - started
            for sign in said:
                if sign == ord("q"):
                    if asked == answered:
                        quiet_since = now
                    asked += 1
                elif sign == ord("a"):
                    answered += 1
                    quiet_since = now
                    if waiting is not None:
                        waiting.heard()
            if not ready:
                if now - started > CHILD_START_S:
                    proc.kill()
                    proc.communicate()
                    return ChildAnswer.failed(HubFailure.TRANSIENT,
                                              f"the download process did not start within {CHILD_START_S:.0f} s")
                continue
            if progress_dir is not None:
                current = _bytes_under(progress_dir)
                if current != last_bytes:
                    if last_bytes >= 0:  # a new byte: the hub is sending
                        quiet_since = now
                        if waiting is not None:
                            waiting.heard()
                    last_bytes, last_change = current, now
                    if on_progress:
                        on_progress(current)
            if now - last_change > limit:
                proc.kill()
                proc.communicate()
                what = "sent no data" if progress_dir is not None else "did not answer"
                return ChildAnswer.failed(HubFailure.STALLED, f"the hub {what} for {limit:.0f} s")
            if waiting is not None and asked > answered:
                waiting.began(quiet_since)
                waiting.tell(now)
                try_over = now - quiet_since >= waiting.per_try_s and not waiting.spent(options.retry_wait_s, now)
                if try_over or waiting.silent_s(now) >= waiting.limit_s:
                    proc.kill()
                    proc.communicate()
                    return ChildAnswer.failed(
                        HubFailure.SILENT, f"the hub at {host()} answered nothing for {int(waiting.silent_s(now))} s",
                        limit_s=waiting.limit_s)
    finally:
        os.close(ready_read)
        if proc.poll() is None:  # the run was cancelled (KeyboardInterrupt, termination): stop the download too
            proc.kill()
            proc.wait()
    for line in _redact(err, token).splitlines():
        if line.strip():
            log.debug("huggingface_hub: %s", line)
    try:
        return ChildAnswer.from_json(json.loads(out.strip().splitlines()[-1]))
    except (json.JSONDecodeError, IndexError, KeyError, TypeError, ValueError, AttributeError):
        return ChildAnswer.failed(
            HubFailure.TRANSIENT, f"download process exited with code {proc.returncode}: {_redact(err, token)[-500:]}")


def _classify(exc: BaseException, request: dict) -> ChildAnswer:
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    detail = f"{type(exc).__name__}: {str(exc).strip()}"[:800]
    # By class name: huggingface_hub's HTTP client has been httpx and is now httpx2.
    if any(cls.__name__ == "TimeoutException" for cls in type(exc).__mro__):
        waited = request.get("read_timeout") or request.get("timeout")
        return ChildAnswer.failed(HubFailure.STALLED, f"the hub sent no data for {waited:.0f} s")
    kinds = [(errors.GatedRepoError, HubFailure.GATED), (errors.RevisionNotFoundError, HubFailure.REVISION),
             (errors.RemoteEntryNotFoundError, HubFailure.ENTRY),
             (errors.RepositoryNotFoundError, HubFailure.NOT_FOUND)]
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return ChildAnswer.failed(HubFailure.OFFLINE, detail)
    for cls, kind in kinds:
        if isinstance(exc, cls):
            return ChildAnswer.failed(kind, detail, status=status)
    if isinstance(exc, errors.HfHubHTTPError) and status in (401, 403):
        return ChildAnswer.failed(HubFailure.UNAUTHORIZED if status == 401 else HubFailure.FORBIDDEN, detail,
                                  status=status)
    if isinstance(exc, errors.HfHubHTTPError) and status is not None and status < 500 and status not in (408, 429):
        return ChildAnswer.failed(HubFailure.HTTP, detail, status=status)
    if status is None and any(sign in detail for sign in UNREACHABLE_SIGNS):
        # No name resolution or nothing listening: offline or a wrong HF_ENDPOINT, and retrying won't help.
        return ChildAnswer.failed(HubFailure.UNREACHABLE, detail)
    # Connection errors, timeouts, 5xx, 429, size mismatches after a cut connection: worth retrying.
    return ChildAnswer.failed(HubFailure.TRANSIENT, detail, status=status)


def partial_files(folder: Path) -> list[Path]:
    """The temp files huggingface_hub is writing (or a killed download left) for ``folder``."""
    download_dir = folder / HF_CACHE_DIR / "huggingface" / "download"
    return list(download_dir.rglob("*" + INCOMPLETE_SUFFIX)) if download_dir.is_dir() else []


def _has_partial(folder: Path, *, at_least: int) -> bool:
    """A partial file of ``folder`` holds ``at_least`` bytes: a download is mid-file."""
    for partial in partial_files(folder):
        with contextlib.suppress(FileNotFoundError):  # huggingface_hub renames it when the file is done
            if partial.stat().st_size >= at_least:
                return True
    return False


def _resume_partials(request: dict, token: str | bool) -> list[str]:
    """Finish the files an earlier, killed download left partial; return those now complete.

    huggingface_hub resumes a cut connection only within one process: a new process starts each
    file from byte 0 in a fresh temp file. A killed process leaves its temp file behind, so this
    continues it with a Range request (the hub and its CDN honour them) before the snapshot call.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    folder = Path(request["local_dir"])
    partials = partial_files(folder)
    done = []
    for rel, remote in request["remote"].items():
        mine = sorted((p for p in partials if _partial_etag(p, {remote["etag"]})), key=lambda p: p.stat().st_size)
        if not mine:
            continue
        partial = mine[-1]
        for other in mine[:-1]:
            other.unlink(missing_ok=True)
        have = partial.stat().st_size
        if have == 0 or have > remote["size"]:
            partial.unlink()
            continue
        if have < remote["size"]:
            headers = {**build_hf_headers(token=token), "Range": f"bytes={have}-", "Accept-Encoding": "identity"}
            url = hf_hub_url(request["repo_id"], rel, repo_type=request["kind"], revision=request["commit"])
            with get_session().stream("GET", url, headers=headers, timeout=request["read_timeout"]) as response:
                hf_raise_for_status(response)
                with open(partial, "ab" if response.status_code == 206 else "wb") as fh:
                    for chunk in response.iter_bytes(request["chunk_bytes"]):
                        fh.write(chunk)
        if partial.stat().st_size == remote["size"]:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, folder / rel)
            done.append(rel)
    return done


def _fetch_range(request: dict, token: str | bool) -> ChildAnswer:
    """Bytes [start, end) of one file at a commit into ``out``, continuing what an earlier try left there.

    The file's metadata comes first (huggingface_hub's ``get_hf_file_metadata``: the commit the hub
    resolved and the file's etag and size), then one ``Range`` GET through huggingface_hub's own
    session and headers (so the token is handled as for every other download). A hub that ignores the
    range (200 instead of 206) is refused rather than followed: it would send the whole file.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(request["repo_id"], request["path"], repo_type=request["kind"], revision=request["commit"])
    meta = get_hf_file_metadata(url, token=token, timeout=request["timeout"])
    out = Path(request["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    have = out.stat().st_size if out.is_file() else 0
    want = request["end"] - request["start"]
    if have > want:
        out.unlink()
        have = 0
    if have < want:
        headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity",
                   "Range": f"bytes={request['start'] + have}-{request['end'] - 1}"}
        with get_session().stream("GET", url, headers=headers, timeout=request["read_timeout"]) as response:
            hf_raise_for_status(response)
            if response.status_code != 206:
                return ChildAnswer.failed(HubFailure.NO_RANGE, f"the hub answered {response.status_code} to a Range "
                                          f"request for {request['path']}", status=response.status_code)
            with open(out, "ab") as fh:
                for chunk in response.iter_bytes():  # as they arrive: a cut connection keeps every byte received
                    fh.write(chunk[:want - fh.tell()])
                    fh.flush()
    return ChildAnswer(ok=True, commit=meta.commit_hash, etag=meta.etag or "", size=meta.size)


_SIGNAL_FD: int | None = None  # in the child: the ready pipe, kept open for the request and answer signs


def _signal_parent(sign: bytes) -> None:
    if _SIGNAL_FD is not None:
        with contextlib.suppress(OSError):  # the watchdog is gone: nobody to tell
            os.write(_SIGNAL_FD, sign)


def _tell_parent_ready() -> None:
    """Tell the watchdog (_run_child) that the slow start is over: its stall clock starts now."""
    global _SIGNAL_FD
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is not None:
        _SIGNAL_FD = int(fd)
        _signal_parent(b"r")


def _watch_requests() -> None:
    """Tell the watchdog of every request sent ("q") and every answer received ("a", its headers), through
    huggingface_hub's shared HTTP client (also one it makes anew, after an SSL error)."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    def client_factory():
        client = default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks,
                              "request": [*hooks.get("request", []), lambda _request: _signal_parent(b"q")],
                              "response": [*hooks.get("response", []), lambda _response: _signal_parent(b"a")]}
        return client

    set_client_factory(client_factory)


def _child_main() -> None:
    request = json.loads(sys.stdin.read())
    token = request.pop("token") or False  # False: send no token at all, not even a stored one
    try:
        from huggingface_hub import HfApi, snapshot_download

        _watch_requests()
        _tell_parent_ready()
        if request["op"] == "list":
            api = HfApi(token=token)
            info = api.repo_info(request["repo_id"], repo_type=request["kind"], revision=request["revision"],
                                 timeout=request["timeout"])
            files = [{"path": f.path, "size": f.size, "blob_id": f.blob_id,
                      "sha256": f.lfs.sha256 if f.lfs else None}
                     for f in api.list_repo_tree(request["repo_id"], repo_type=request["kind"], revision=info.sha,
                                                 recursive=True)
                     if hasattr(f, "blob_id")]
            answer = ChildAnswer(ok=True, commit=info.sha, files=tuple(RemoteFile(**f) for f in files))
        elif request["op"] == "range":
            answer = _fetch_range(request, token)
        else:
            from huggingface_hub import constants

            constants.DOWNLOAD_CHUNK_SIZE = request["chunk_bytes"]
            resumed = _resume_partials(request, token)
            rest = [rel for rel in request["remote"] if rel not in resumed]
            if rest:
                snapshot_download(request["repo_id"], repo_type=request["kind"], revision=request["commit"],
                                  local_dir=request["local_dir"], allow_patterns=rest, token=token,
                                  etag_timeout=request["timeout"], max_workers=request["max_workers"])
            answer = ChildAnswer(ok=True, resumed=tuple(resumed))
    except Exception as exc:  # every failure goes back to the watchdog, classified
        answer = _classify(exc, request)
    sys.stdout.write("\n" + json.dumps(answer.to_json()) + "\n")


# ---------------------------------------------------------------- the public calls

def _fail(ref: RepoRef, answer: ChildAnswer, *, token: str | None, attempts: int, pinned: bool) -> HubError:
    kind, detail = answer.kind or HubFailure.TRANSIENT, _redact(answer.detail, token)
    where = f"{ref} ({ref.kind} repo on {endpoint()})"
    bound_s = answer.limit_s if answer.limit_s is not None else DEFAULT_ANSWER_TIMEOUT_S
    messages = {
        HubFailure.NOT_FOUND:
            f"{where}: not found. Check the id (owner/name"
            f"{', and that it is a dataset' if ref.kind == 'dataset' else ''}). If it is private, set HF_TOKEN to a "
            "token of an account that can read it.",
        HubFailure.GATED:
            f"{where} is gated and no token was given. Accept its terms on {ref.web_url}, then set HF_TOKEN to a read "
            "token of that account." if not token else
            f"{where} is gated and HF_TOKEN has no access to it. Request or accept access on {ref.web_url} with the "
            "account the token belongs to, or use a token of an account that has access.",
        HubFailure.UNAUTHORIZED:
            f"{where}: HF_TOKEN was rejected (invalid or expired). Create a new read token at "
            "https://huggingface.co/settings/tokens and set HF_TOKEN to it.",
        HubFailure.FORBIDDEN:
            f"{where}: HF_TOKEN is not allowed to read this repo. Use a token with read access to it.",
        HubFailure.REVISION:
            f"{where}: the pinned commit recorded in materials/manifest.json no longer exists upstream (the history "
            "was rewritten). Set an explicit revision (owner/name@branch-or-commit) to pin anew." if pinned else
            f"{where}: revision {ref.revision or 'main'!r} not found. Use a branch, tag or commit that exists (see "
            f"{ref.web_url}/commits/main).",
        HubFailure.ENTRY:
            f"{where}: a file the repo lists is missing on the server (404). The repo may be changing; run again "
            "later or pin another revision.",
        HubFailure.STALLED:
            f"{where}: {detail} ({attempts} tries). Check the network or proxy, then run again: finished files are "
            "kept and partial ones resume.",
        HubFailure.SILENT:
            f"{where}: {detail} ({attempts} {'try' if attempts == 1 else 'tries'}, each on a new connection). Check "
            f"that the hub at {endpoint()} works (HF_ENDPOINT chooses it; a mirror may have stalled) and that no proxy "
            "or firewall holds the connection, then run again: finished files are kept. The wait is bounded by "
            f"{ANSWER_TIMEOUT_ENV} (now {bound_s:.0f} s); raise it for a mirror that is slow to answer.",
        HubFailure.OFFLINE:
            f"{where} is not downloaded yet and HF_HUB_OFFLINE is set. Unset it for one run, or set a local folder "
            "instead of the repo id.",
        HubFailure.TRANSIENT:
            f"{where}: the download failed {attempts} times. Run again to resume. Last error: {detail}",
        HubFailure.UNREACHABLE:
            f"{where}: the hub cannot be reached ({(detail or 'no answer').splitlines()[0][:200]}). Are you offline? "
            "Set a local folder (relative to the project) instead of the repo id, or point HF_ENDPOINT at a hub mirror "
            "you can reach.",
    }
    message = messages.get(kind, f"{where}: the hub answered an error. {detail}")
    if kind not in (*TRANSIENT_KINDS, HubFailure.OFFLINE, HubFailure.UNREACHABLE) and detail:
        message += f" (hub said: {detail.splitlines()[0][:300]})"
    return HubError(kind, message)


_WARNED_CLEAR_TEXT: set[str] = set()
_LOOPBACK_HOSTS = ("localhost", "127.", "[::1]")


def warn_if_token_in_clear_text(token: str | None) -> None:
    """A token sent over plain http can be read on the way; say so (once per endpoint), and still send it."""
    url = endpoint()
    if not token or not url.startswith("http://") or url in _WARNED_CLEAR_TEXT:
        return
    host = url[len("http://"):].split("/")[0]
    if host.startswith(_LOOPBACK_HOSTS):  # it never leaves this machine
        return
    _WARNED_CLEAR_TEXT.add(url)
    log.warning("HF_ENDPOINT is %s: plain http, so your HF token is sent unencrypted and anyone on the way can read "
                "it. Use an https:// endpoint, or unset HF_TOKEN for public repos.", url)


def list_repo(ref: RepoRef, *, revision: str | None = None, token: str | None = None,
              options: HubOptions | None = None) -> Listing:
    """Resolve ``revision`` (default: the ref's, else main) to a commit and list its files."""
    options = options or HubOptions()
    revision = revision or ref.revision or "main"
    warn_if_token_in_clear_text(token)
    answer = ChildAnswer(ok=False)
    waiting = Waiting(f"listing {ref}", options.answer_timeout_s, options.attempts)
    tries = 0
    for tries in range(1, options.attempts + 1):
        answer = _run_child({"op": "list", "repo_id": ref.repo_id, "kind": ref.kind, "revision": revision,
                             "timeout": options.api_timeout_s}, token=token, options=options, progress_dir=None,
                            waiting=waiting)
        if not answer.retryable or tries == options.attempts:  # the last try's failure is the error raised below
            break
        log.warning("%s: listing failed (try %d of %d): %s", ref, tries, options.attempts,
                    _redact(answer.detail, token))
        if waiting.over():  # the hub has answered nothing for the whole bound
            break
        time.sleep(waiting.pause_s(options.retry_wait_s))
    if not answer.ok:
        raise _fail(ref, answer, token=token, attempts=tries, pinned=bool(COMMIT.match(revision)))
    return Listing(answer.commit or "", {f.path: f for f in answer.files})


def download(ref: RepoRef, listing: Listing, folder: Path, *, token: str | None = None,
             options: HubOptions | None = None, cache: dict | None = None) -> tuple[dict, TransferStats]:
    """Download the files of ``listing`` into ``folder`` by commit and verify every one of them.

    Stalls, dropped connections and files that fail verification are retried up to
    ``options.attempts`` times; a corrupted file is deleted and fetched again, never kept.
    Returns the verification cache of the files and what the transfer took. A hub that answers nothing
    at all is given up on after ``options.answer_timeout_s`` (over all the tries).
    """
    options = options or HubOptions()
    stats, started = TransferStats(), time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    bad, verified = verify(folder, listing, cache or {})
    last_log = [time.monotonic()]
    total = listing.total_bytes

    def progress(current: int) -> None:
        # Only in fault-injection runs. Once a whole chunk is on disk, the kill lands mid-file: a file smaller than a
        # chunk (config.json, say) is written and renamed at once, and which of them a poll catches is chance.
        if faults.armed("download") and _has_partial(folder, at_least=options.chunk_bytes):
            faults.point("download")
        if time.monotonic() - last_log[0] > 10:
            last_log[0] = time.monotonic()
            log.info("%s: %.1f of %.1f MiB on disk", ref, current / 2**20, total / 2**20)

    answer = ChildAnswer(ok=True)
    corrupt: list[str] = []
    waiting = Waiting(f"downloading {ref}", options.answer_timeout_s, options.attempts)  # .what: set per try
    while bad:
        stats.attempts += 1
        for rel in bad:  # a present but wrong file must go, or huggingface_hub would keep it
            path = folder / rel
            if path.is_file():
                path.unlink()
        log.info("%s: fetching %d file(s) at %s (try %d of %d)", ref, len(bad), listing.commit[:12],
                 stats.attempts, options.attempts)
        remote = {rel: {"etag": listing.files[rel].etag, "size": listing.files[rel].size} for rel in bad}
        waiting.what = f"downloading {len(bad)} file(s) of {ref}"
        answer = _run_child({"op": "download", "repo_id": ref.repo_id, "kind": ref.kind, "commit": listing.commit,
                             "local_dir": str(folder), "remote": remote, "timeout": options.api_timeout_s,
                             "read_timeout": max(1.0, options.stall_timeout_s / 2), "max_workers": options.max_workers,
                             "chunk_bytes": options.chunk_bytes},
                            token=token, options=options, progress_dir=folder, on_progress=progress,
                            waiting=waiting)
        if not answer.ok and not answer.retryable:
            raise _fail(ref, answer, token=token, attempts=stats.attempts, pinned=True)
        still_bad, newly = verify(folder, listing.subset(bad), {})
        verified.update(newly)
        stats.downloaded_bytes += sum(listing.files[rel].size for rel in newly)
        corrupt = [rel for rel in still_bad if (folder / rel).is_file()
                   and (folder / rel).stat().st_size == listing.files[rel].size]
        stats.refetched += len(corrupt)
        if corrupt:
            log.warning("%s: %s did not match the checksum the hub announced; deleted, fetching again",
                        ref, ", ".join(corrupt))
        if not answer.ok:
            log.warning("%s: try %d failed: %s", ref, stats.attempts, _redact(answer.detail, token))
        bad = still_bad
        if bad and (stats.attempts >= options.attempts or waiting.over()):
            break
        if bad:
            time.sleep(waiting.pause_s(options.retry_wait_s))
    stats.seconds = time.monotonic() - started
    if bad:
        for rel in corrupt:  # never left where a later step could load it
            (folder / rel).unlink(missing_ok=True)
        if not answer.ok:
            raise _fail(ref, answer, token=token, attempts=stats.attempts, pinned=True)
        raise HubError(HubFailure.CORRUPT,
                       f"{ref}: {', '.join(bad)} arrived with a different checksum or size than the hub announced, "
                       f"{stats.attempts} times; the bad copies were deleted. Check for a proxy rewriting downloads, "
                       "or run again later.")
    return verified, stats


def fetch_range(ref: RepoRef, commit: str, path: str, start: int, end: int, out: Path, *,
                token: str | None = None, options: HubOptions | None = None) -> ChildAnswer:
    """Bytes [start, end) of ``path`` at ``commit`` into the file ``out`` (resumed from what it holds, tried
    again on stalls and dropped connections); returns the hub's metadata of the file: the commit it
    resolved, its etag and size. Only that range crosses the network."""
    options = options or HubOptions()
    warn_if_token_in_clear_text(token)
    waiting = Waiting(f"reading {path} of {ref}", options.answer_timeout_s, options.attempts)
    answer = ChildAnswer(ok=False)
    tries = 0
    for tries in range(1, options.attempts + 1):
        answer = _run_child({"op": "range", "repo_id": ref.repo_id, "kind": ref.kind, "commit": commit,
                             "path": path, "start": start, "end": end, "out": str(out),
                             "timeout": options.api_timeout_s, "read_timeout": max(1.0, options.stall_timeout_s / 2),
                             "chunk_bytes": options.chunk_bytes},
                            token=token, options=options, progress_dir=out.parent, waiting=waiting)
        have = out.stat().st_size if out.is_file() else 0
        if answer.ok and have == end - start:
            return answer
        if answer.ok:
            answer = ChildAnswer.failed(HubFailure.TRANSIENT,
                                        f"the connection closed after {have} of {end - start} bytes")
        if answer.kind == HubFailure.NO_RANGE:
            raise HubError(HubFailure.NO_RANGE, f"{ref}: {answer.detail}; the hub (HF_ENDPOINT={endpoint()}) must "
                                                "honour HTTP Range requests to fetch one tensor without the whole "
                                                "file.")
        if not answer.retryable or waiting.over():
            break
        log.warning("%s: reading bytes of %s failed (try %d of %d): %s", ref, path, tries, options.attempts,
                    _redact(answer.detail, token))
        if tries < options.attempts:
            time.sleep(waiting.pause_s(options.retry_wait_s))
    raise _fail(ref, answer, token=token, attempts=tries, pinned=True)


if __name__ == "__main__":
    _child_main()
