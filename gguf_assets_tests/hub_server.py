"""A loopback Hugging Face hub: a stdlib HTTP server on 127.0.0.1 that speaks the hub protocol.

It serves repos built from local folders, so the real ``huggingface_hub`` client (and with it
``gguf_assets.lib.materials.hub``) talks to it exactly as to huggingface.co once ``HF_ENDPOINT`` points here.

Endpoints, as huggingface_hub 2.4 calls them:

* ``GET /api/{models|datasets}/{owner}/{name}[/revision/{rev}]`` → repo info (``sha``, ``siblings``; with
  ``?blobs=true``, as ``repo_info(files_metadata=True)`` asks, each sibling's ``size``, ``blobId`` and, for LFS
  files, ``lfs.sha256``)
* ``GET /api/{models|datasets}/{owner}/{name}/tree/{rev}[/{path}]?recursive=..`` → file listing
  with ``oid`` (git blob id), ``size`` and, for LFS files, ``lfs.oid`` (sha256)
* ``HEAD|GET [/datasets]/{owner}/{name}/resolve/{rev}/{path}`` → the file, with ``X-Repo-Commit``,
  ``ETag`` (sha256 for LFS files, the blob id otherwise), ``Content-Length`` and ``Range`` support
  (``bytes=N-`` and ``bytes=N-M``; ``served`` counts the body bytes sent per file)

Errors carry ``X-Error-Code`` like the hub: ``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``, ``GatedRepo`` (401 without a token, 403 with a token that was not granted),
and 401 ``Invalid credentials in Authorization header`` for an unknown token.

Faults are switched on per test with :meth:`LoopbackHub.add_fault`: ``drop`` (close the
connection mid-file), ``stall`` (stop answering), ``slow`` (a slow mirror that keeps sending: the body
in ``slow_piece_bytes`` pieces, ``slow_s`` apart), ``corrupt`` (flip one byte of the body),
``missing`` (404 EntryNotFound for a listed file) and ``error500``. :meth:`LoopbackHub.go_silent` makes
the whole hub a stalled mirror: it accepts every connection and reads the request, then never sends
a byte, until the hub is closed (or ``go_silent(False)``). Every request is recorded
in :attr:`LoopbackHub.requests` (the Authorization header only as none/granted/no-access/invalid,
never its value).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".parquet", ".gguf")
LFS_MIN_BYTES = 100_000
FAULT_ACTIONS = ("drop", "stall", "slow", "corrupt", "missing", "error500")
# Written to HF_HOME/token by the loopback_hub fixture: a token stored on the machine, never to be sent.
STORED_HF_TOKEN = "hf_stored_on_this_machine_never_send"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_BYTES


@dataclass
class _Repo:
    repo_id: str
    kind: str
    gated: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    announced_sizes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Fault:
    action: str
    path_contains: str
    method: str | None
    times: int
    after_bytes: int
    hits: int = 0


def _read_folder(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class LoopbackHub:
    """``with LoopbackHub() as hub: hub.add_repo("org/model", folder)``; ``hub.url`` is the endpoint."""

    def __init__(self, *, token: str = "hf_loopback_granted_0123456789",
                 no_access_token: str = "hf_loopback_not_granted_9876543210", stall_s: float = 30.0,
                 slow_s: float = 0.15, slow_piece_bytes: int = 32 << 10) -> None:
        self.token = token
        self.no_access_token = no_access_token
        self.stall_s = stall_s
        self.slow_s, self.slow_piece_bytes = slow_s, slow_piece_bytes
        self.silent = False
        self.requests: list[dict] = []
        self.served: dict[str, int] = {}  # file path -> body bytes sent for it (GET), over all requests
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-hub", daemon=True)

    # lifecycle
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "LoopbackHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    # repos
    def add_repo(self, repo_id: str, source: Path | dict[str, bytes], *, kind: str = "model",
                 gated: bool = False) -> str:
        """Create a repo whose ``main`` is one commit holding ``source`` (a folder or {path: bytes})."""
        repo = _Repo(repo_id, kind, gated)
        with self._lock:
            self._repos[(kind, repo_id)] = repo
        return self.push(repo_id, source, kind=kind, replace=True)

    def push(self, repo_id: str, changes: Path | dict[str, bytes | None], *, kind: str = "model",
             branch: str = "main", replace: bool = False) -> str:
        """A new commit on ``branch``: files added/changed, or deleted where the value is None."""
        with self._lock:
            repo = self._repos[(kind, repo_id)]
            new = _read_folder(changes) if isinstance(changes, Path) else dict(changes)
            files = {} if replace else dict(repo.commits.get(repo.refs.get(branch, ""), {}))
            for path, data in new.items():
                if data is None:
                    files.pop(path, None)
                else:
                    files[path] = data
            parent = repo.refs.get(branch, "")
            digest = hashlib.sha1(json.dumps([parent, sorted((p, git_blob_id(d)) for p, d in files.items())])
                                  .encode()).hexdigest()
            repo.commits[digest] = files
            repo.refs[branch] = digest
            return digest

    def head(self, repo_id: str, *, kind: str = "model", branch: str = "main") -> str:
        """The commit ``branch`` points at."""
        with self._lock:
            return self._repos[(kind, repo_id)].refs[branch]

    def announce_size(self, repo_id: str, path: str, size: int, *, kind: str = "model") -> None:
        """Make the listing claim a different size for a file (e.g. a huge one, to fill the disk)."""
        with self._lock:
            self._repos[(kind, repo_id)].announced_sizes[path] = size

    def add_fault(self, action: str, *, path_contains: str, method: str | None = "GET", times: int = 1,
                  after_bytes: int = 0) -> None:
        """The next ``times`` requests whose path contains ``path_contains`` misbehave (times=-1: always)."""
        if action not in FAULT_ACTIONS:
            raise ValueError(f"unknown fault {action!r}; choose from {FAULT_ACTIONS}")
        with self._lock:
            self._faults.append(_Fault(action, path_contains, method, times, after_bytes))

    def go_silent(self, silent: bool = True) -> None:
        """Accept connections and never answer (a stalled mirror), from the next request on."""
        self.silent = silent

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def file_requests(self, path_suffix: str, method: str = "GET") -> list[dict]:
        return [r for r in self.requests if r["method"] == method and "/resolve/" in r["path"]
                and r["path"].endswith(path_suffix)]

    # internals used by the handler
    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.path_contains in path and (fault.method is None or fault.method == method) and (
                        fault.times < 0 or fault.hits < fault.times):
                    fault.hits += 1
                    return fault
        return None

    def _auth(self, header: str | None) -> str:
        if not header:
            return "none"
        value = header.removeprefix("Bearer ").strip()
        if value == self.token:
            return "granted"
        if value == self.no_access_token:
            return "no-access"
        return "invalid"


_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+?)(?:/(revision|tree)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^(/datasets)?/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _make_handler(hub: LoopbackHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:
            self._handle("HEAD")

        def do_GET(self) -> None:
            self._handle("GET")

        # responses
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, *, head: bool) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

        def _json(self, obj, headers: dict | None = None) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _stall(self) -> None:
            hub._stop.wait(hub.stall_s)
            self.close_connection = True

        # routing
        def _handle(self, method: str) -> None:
            split = urlsplit(self.path)
            path, query = split.path, parse_qs(split.query)
            auth = hub._auth(self.headers.get("Authorization"))
            hub.requests.append({"method": method, "path": path, "auth": auth, "range": self.headers.get("Range")})
            head = method == "HEAD"
            if hub.silent:  # a stalled mirror: the connection stays open and nothing ever comes back
                while hub.silent and not hub._stop.wait(0.1):
                    pass
                self.close_connection = True
                return
            if auth == "invalid":
                return self._error(401, None, "Invalid credentials in Authorization header", head=head)
            fault = hub._take_fault(method, path)
            if fault and fault.action == "stall" and not (fault.after_bytes and _RESOLVE.match(path)):
                return self._stall()
            if fault and fault.action == "error500":
                return self._error(500, None, "Internal Error (loopback fault)", head=head)
            if match := _API.match(path):
                return self._api(match, query, auth, head)
            if match := _RESOLVE.match(path):
                return self._resolve(match, auth, head, fault)
            self._error(404, None, f"no route for {path}", head=head)

        def _repo(self, kind: str, repo_id: str, head: bool) -> _Repo | None:
            repo = hub._repos.get((kind, repo_id))
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", head=head)
            return repo

        def _commit(self, repo: _Repo, revision: str, head: bool) -> str | None:
            revision = unquote(revision)
            sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
            return sha

        def _entries(self, repo: _Repo, sha: str) -> list[dict]:
            out, folders = [], set()
            for path, data in sorted(repo.commits[sha].items()):
                size = repo.announced_sizes.get(path, len(data))
                entry = {"type": "file", "oid": git_blob_id(data), "size": size, "path": path}
                if _is_lfs(path, data):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
                out.append(entry)
                parts = path.split("/")[:-1]
                folders.update("/".join(parts[:i + 1]) for i in range(len(parts)))
            out += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
            return out

        def _api(self, match: re.Match, query: dict, auth: str, head: bool) -> None:
            kind = match.group(1)[:-1]
            repo = self._repo(kind, match.group(2), head)
            if repo is None:
                return
            sha = self._commit(repo, match.group(4) or "main", head)
            if sha is None:
                return
            if match.group(3) == "tree":
                prefix = unquote(match.group(5) or "/").strip("/")
                entries = [e for e in self._entries(repo, sha) if not prefix or e["path"].startswith(prefix + "/")]
                if query.get("recursive", ["False"])[0].lower() != "true":
                    depth = prefix.count("/") + 1 if prefix else 0
                    entries = [e for e in entries if e["path"].count("/") == depth]
                return self._json(entries)
            blobs = query.get("blobs", ["False"])[0].lower() == "true"
            siblings = []
            for e in self._entries(repo, sha):
                if e["type"] != "file":
                    continue
                sibling = {"rfilename": e["path"]}
                if blobs:
                    sibling.update(size=e["size"], blobId=e["oid"])
                    if "lfs" in e:
                        sibling["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}
                siblings.append(sibling)
            self._json({"_id": repo.repo_id, "id": repo.repo_id, "sha": sha, "private": False,
                        "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings,
                        "lastModified": "2026-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0})

        def _resolve(self, match: re.Match, auth: str, head: bool, fault: _Fault | None) -> None:
            kind = "dataset" if match.group(1) else "model"
            repo = self._repo(kind, match.group(2), head)
            if repo is None:
                return
            if repo.gated and auth != "granted":
                status = 401 if auth == "none" else 403
                return self._error(status, "GatedRepo", "Access to this model is restricted; ask for access "
                                   "on its page", head=head)
            sha = self._commit(repo, match.group(3), head)
            if sha is None:
                return
            file = unquote(match.group(4))
            data = repo.commits[sha].get(file)
            if data is None or (fault and fault.action == "missing"):
                return self._error(404, "EntryNotFound", f"{file} does not exist on {sha}", head=head)
            etag = hashlib.sha256(data).hexdigest() if _is_lfs(file, data) else git_blob_id(data)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if _is_lfs(file, data):
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": len(data)})
            start, stop = 0, len(data)
            if (rng := self.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-(\d*)$", rng.strip())):
                start = min(int(m.group(1)), len(data))
                if m.group(2):  # an inclusive end, as HTTP ranges are
                    stop = max(start, min(int(m.group(2)) + 1, len(data)))
            partial = (start, stop) != (0, len(data))
            body = data[start:stop]
            if not head:
                with hub._lock:
                    hub.served[file] = hub.served.get(file, 0) + len(body)
            if fault and fault.action == "corrupt" and body:
                flip = len(body) // 2
                body = body[:flip] + bytes([body[flip] ^ 0x01]) + body[flip + 1:]
            status = 206 if partial else 200
            if partial:
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if head:
                return
            if fault and fault.action in ("drop", "stall"):
                # Promise the whole body, send it up to byte after_bytes of the file, then hang up or
                # go silent; a resumed request that starts past that point fails at once.
                self.wfile.write(body[:max(0, fault.after_bytes - start)])
                self.wfile.flush()
                if fault.action == "stall":
                    self._stall()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault and fault.action == "slow":
                for at in range(0, len(body), hub.slow_piece_bytes):
                    self.wfile.write(body[at:at + hub.slow_piece_bytes])
                    self.wfile.flush()
                    if hub._stop.wait(hub.slow_s):
                        return
                return
            self.wfile.write(body)

    return Handler
