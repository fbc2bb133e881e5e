"""One pipeline per project folder: an flock on <project>/.pipeline.lock.

The kernel drops an flock when its holder dies, so a lock left by a killed process is
taken over without any guessing about stale pids; the pid and start time written into
the file are only there to tell the user who holds it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import secrets
from pathlib import Path

from gguf_assets.lib.liveness import process_alive


class ProjectLocked(RuntimeError):
    pass


# Lock files this process holds, with a nesting count: the CLI holds the lock for a whole
# `run`, and each asset step (which may run in that same process) takes it again.
_held: dict[Path, list] = {}  # path -> [fd, nesting count, token]


class ProjectLock:
    """Exclusive lock on a project folder.

    ``join_token``: a worker process launched by the pipeline that holds the lock (parallel
    shard runs) passes the holder's token and joins it instead of being refused.
    """

    def __init__(self, lock_file: Path, *, join_token: str | None = None) -> None:
        self.lock_file = Path(lock_file).resolve()
        self.join_token = join_token
        self.joined = False

    @property
    def token(self) -> str:
        """Hand this to worker processes so they can join (only valid while held)."""
        return _held[self.lock_file][2]

    def __enter__(self) -> "ProjectLock":
        if self.lock_file in _held:
            _held[self.lock_file][1] += 1
            return self
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if self.join_token and holder.get("token") == self.join_token and process_alive(int(holder.get("pid", -1))):
                self.joined = True
                return self
            raise ProjectLocked(
                f"{self.lock_file.parent} is in use by another pipeline (pid {holder.get('pid', '?')}, started "
                f"{holder.get('started', '?')}). Wait for it to finish or stop it; two pipelines must not write "
                "the same project folder.") from None
        os.ftruncate(fd, 0)
        token = secrets.token_hex(8)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": dt.datetime.now().isoformat(timespec="seconds"),
                                  "token": token}).encode(), 0)
        os.fsync(fd)
        _held[self.lock_file] = [fd, 1, token]
        return self

    def __exit__(self, *exc) -> None:
        if self.joined:
            return
        entry = _held.get(self.lock_file)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.lock_file]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
