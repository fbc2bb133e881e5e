"""How the watchdog (parent) and the child process talk: everything both sides must spell the same, in one place.

1. The parent starts ``python -m gguf_assets.lib.materials.hub`` (``CHILD_MODULE``) with one end of a pipe open in
   it, its number in ``READY_FD_ENV``, and writes one JSON request to the child's stdin: ``{"op": LIST | DOWNLOAD |
   RANGE, ..., "token"}`` (the token only there: never in argv, the environment, a file or a log line).
2. On that pipe the child writes one byte per event: ``READY`` once its imports are done (the parent's clocks start
   then, not at the slow start), ``REQUEST`` for each HTTP request it sends and ``ANSWER`` for each answer's headers
   it gets; from these the watchdog tells a hub that answers nothing from a slow one.
3. The child ends with one JSON line on its stdout, its ``ChildAnswer``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gguf_assets.lib.materials.hub.records import TRANSIENT_KINDS, HubFailure, RemoteFile

CHILD_MODULE = __package__  # run as ``python -m``: the package's __main__ is the child's main
READY_FD_ENV = "GGUF_ASSETS_HUB_READY_FD"  # the number of the signal pipe's write end, in the child

# The signal pipe's bytes, child to parent.
READY = b"r"  # imports done: the request is about to go out
REQUEST = b"q"  # an HTTP request was sent
ANSWER = b"a"  # an HTTP answer (its headers) arrived

# The request's "op".
LIST = "list"  # resolve a revision to a commit and list its files
DOWNLOAD = "download"  # fetch files of a commit into a folder, resuming partial ones
RANGE = "range"  # bytes [start, end) of one file into a file


def signs(said: bytes) -> list[bytes]:
    """The one-byte signs in what the parent read from the pipe, in order."""
    return [said[i:i + 1] for i in range(len(said))]


@dataclass(frozen=True)
class ChildAnswer:
    """What a child process (``child.main``) answers for its one request, as one JSON line on its stdout; or what
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
