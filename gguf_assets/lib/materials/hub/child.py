"""The child process's side: one request from stdin, huggingface_hub's calls, one ``ChildAnswer`` line on stdout.

It runs as ``python -m gguf_assets.lib.materials.hub`` (the package's ``__main__``), started and watched by
``watchdog._run_child``. huggingface_hub reads its endpoint, timeouts and the implicit-token, Xet and telemetry
switches from the environment when it is imported, and its API calls have no timeout, so only a fresh process can be
configured reliably and killed when it stalls.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from gguf_assets.lib.materials.hub import hf_private
from gguf_assets.lib.materials.hub.protocol import (
    ANSWER,
    DOWNLOAD,
    LIST,
    RANGE,
    READY,
    READY_FD_ENV,
    REQUEST,
    ChildAnswer,
)
from gguf_assets.lib.materials.hub.records import HubFailure, RemoteFile

# How "the hub cannot be reached at all" reads in the HTTP client's errors (glibc, macOS, httpx).
UNREACHABLE_SIGNS = ("Name or service not known", "Temporary failure in name resolution",
                     "nodename nor servname", "No address associated with hostname", "Connection refused",
                     "Network is unreachable", "getaddrinfo failed")
# A listing takes repo_info's files (one call) only when it has fewer: the hub may cut a long list short, or send
# none, and the tree listing (paginated, one more call per 1,000 files) is then the complete one. huggingface_hub
# 1.x's own rule for snapshot_download (its PRs #3241 and #3565).
SIBLINGS_TRUSTED_BELOW = 1000


def main() -> None:
    request = json.loads(sys.stdin.read())
    token = request.pop("token") or False  # False: send no token at all, not even a stored one
    try:
        _load_client()
        hf_private.watch_client(lambda: _signal_parent(REQUEST), lambda: _signal_parent(ANSWER))
        _tell_parent_ready()
        answer = OPERATIONS[request["op"]](request, token)
    except Exception as exc:  # every failure goes back to the watchdog, classified
        answer = _classify(exc, request)
    sys.stdout.write("\n" + json.dumps(answer.to_json()) + "\n")


def _load_client() -> None:
    """Import what the operations call, before the parent is told the start is over: the slow part of a start."""
    from huggingface_hub import HfApi, snapshot_download  # noqa: F401


# ---------------------------------------------------------------- the operations

def _list(request: dict, token: str | bool) -> ChildAnswer:
    """The commit ``revision`` resolves to and its files, with the size and checksum of each: one repo_info call
    with the files' metadata, and the tree listing only where that list cannot be trusted to be whole."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    info = api.repo_info(request["repo_id"], repo_type=request["kind"], revision=request["revision"],
                         timeout=request["timeout"], files_metadata=True)
    files = _sibling_files(info.siblings)
    if files is None:
        files = [RemoteFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
                 for f in api.list_repo_tree(request["repo_id"], repo_type=request["kind"], revision=info.sha,
                                             recursive=True)
                 if hasattr(f, "blob_id")]
    return ChildAnswer(ok=True, commit=info.sha, files=tuple(files))


def _sibling_files(siblings) -> list[RemoteFile] | None:
    """repo_info's files, or None where the tree listing must be asked: none listed, a list that may be cut short,
    or a file without its size or blob id."""
    if not siblings or len(siblings) >= SIBLINGS_TRUSTED_BELOW:
        return None
    if any(s.size is None or s.blob_id is None for s in siblings):
        return None
    return [RemoteFile(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs is not None else None)
            for s in siblings]


def _download(request: dict, token: str | bool) -> ChildAnswer:
    """The files of ``remote`` at ``commit`` into ``local_dir``: partial ones continued first, the rest by
    snapshot_download."""
    from huggingface_hub import snapshot_download

    hf_private.set_download_chunk_size(request["chunk_bytes"])
    resumed = _resume_partials(request, token)
    rest = [rel for rel in request["remote"] if rel not in resumed]
    if rest:
        snapshot_download(request["repo_id"], repo_type=request["kind"], revision=request["commit"],
                          local_dir=request["local_dir"], allow_patterns=rest, token=token,
                          etag_timeout=request["timeout"], max_workers=request["max_workers"])
    return ChildAnswer(ok=True, resumed=tuple(resumed))


def _resume_partials(request: dict, token: str | bool) -> list[str]:
    """Finish the files an earlier, killed download left partial; return those now complete.

    huggingface_hub resumes a cut connection only within one process: a new process starts each
    file from byte 0 in a fresh temp file. A killed process leaves its temp file behind, so this
    continues it with a Range request (the hub and its CDN honour them) before the snapshot call.
    """
    folder = Path(request["local_dir"])
    partials = hf_private.partial_files(folder)
    done = []
    for rel, remote in request["remote"].items():
        mine = sorted((p for p in partials if hf_private.partial_etag(p, {remote["etag"]})),
                      key=lambda p: p.stat().st_size)
        if not mine:
            continue
        partial = mine[-1]
        for other in mine[:-1]:
            other.unlink(missing_ok=True)
        if _continue_partial(request, rel, remote["size"], partial, token):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, folder / rel)
            done.append(rel)
    return done


def _continue_partial(request: dict, rel: str, size: int, partial: Path, token: str | bool) -> bool:
    """Fetch the rest of ``partial`` (a Range request from its length); whether it now holds the whole file. One
    that is empty or longer than the file is deleted."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    have = partial.stat().st_size
    if have == 0 or have > size:
        partial.unlink()
        return False
    if have < size:
        headers = {**build_hf_headers(token=token), "Range": f"bytes={have}-", "Accept-Encoding": "identity"}
        url = hf_hub_url(request["repo_id"], rel, repo_type=request["kind"], revision=request["commit"])
        with get_session().stream("GET", url, headers=headers, timeout=request["read_timeout"]) as response:
            hf_raise_for_status(response)
            with open(partial, "ab" if response.status_code == 206 else "wb") as fh:
                for chunk in response.iter_bytes(request["chunk_bytes"]):
                    fh.write(chunk)
    return partial.stat().st_size == size


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


OPERATIONS = {LIST: _list, DOWNLOAD: _download, RANGE: _fetch_range}


# ---------------------------------------------------------------- failures

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


# ---------------------------------------------------------------- the signal pipe

_SIGNAL_FD: int | None = None  # the pipe to the watchdog, kept open for the request and answer signs


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
        _signal_parent(READY)
