"""One pipeline per project folder: an flock on <project>/.pipeline.lock.

The kernel drops an flock when its holder dies, so a lock left by a killed process is
taken over without any guessing about stale pids; the pid, start time and Dagster run
written into the file are only there to tell the user who holds it.

A worker of the holder's own pipeline (a Dagster run that `gguf-trainer run --workers N`
launched through the run launcher) shares its lock when it names the holder's pid and that
process is one of its ancestors. Nothing secret is written anywhere; an unrelated process,
or any other descendant (a run launched from a UI that the holder started), is refused.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from pathlib import Path

import psutil

from gguf_assets.lib.errors import UserError


class ProjectLocked(UserError, RuntimeError):
    pass


# Lock files this process holds, with a nesting count: the CLI holds the lock for a whole
# `run`, and each Dagster run (which may execute in that same process) takes it again.
_held: dict[Path, list] = {}  # path -> [fd, nesting count]


def _is_ancestor(pid: int) -> bool:
    try:
        return any(parent.pid == pid for parent in psutil.Process().parents())
    except psutil.Error:
        return False


class ProjectLock:
    """Exclusive lock on a project folder; ``describe`` is shown to whoever is refused (e.g. the run)."""

    def __init__(self, lock_file: Path, *, describe: str = "", leader_pid: int | None = None) -> None:
        self.lock_file = Path(lock_file).resolve()
        self.describe = describe
        self.leader_pid = leader_pid
        self.shared_with: int | None = None  # the ancestor pid whose lock this process shares

    def __enter__(self) -> "ProjectLock":
        if self.lock_file in _held:
            _held[self.lock_file][1] += 1
            return self
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            pid = int(holder.get("pid", -1))
            if pid > 0 and pid == self.leader_pid and _is_ancestor(pid):
                self.shared_with = pid
                return self
            what = f", {holder['what']}" if holder.get("what") else ""
            raise ProjectLocked(
                f"{self.lock_file.parent} is in use by another pipeline (pid {holder.get('pid', '?')}, started "
                f"{holder.get('started', '?')}{what}). Wait for it to finish or stop it; two pipelines must not "
                "write the same project folder.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": dt.datetime.now().isoformat(timespec="seconds"),
                                  "what": self.describe}).encode(), 0)
        os.fsync(fd)
        _held[self.lock_file] = [fd, 1]
        return self

    def __exit__(self, *exc) -> None:
        if self.shared_with is not None:
            return
        entry = _held.get(self.lock_file)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.lock_file]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


def is_locked(lock_file: Path) -> bool:
    """True while some process holds the lock (this one included); takes nothing."""
    lock_file = Path(lock_file).resolve()
    if lock_file in _held:
        return True
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
