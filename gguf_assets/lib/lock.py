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
from pathlib import Path


class ProjectLocked(RuntimeError):
    pass


# Lock files this process holds, with a nesting count: the CLI holds the lock for a whole
# `run`, and each asset step (which may run in that same process) takes it again.
_held: dict[Path, list[int]] = {}


class ProjectLock:
    def __init__(self, lock_file: Path) -> None:
        self.lock_file = Path(lock_file).resolve()

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
            raise ProjectLocked(
                f"{self.lock_file.parent} is in use by another pipeline (pid {holder.get('pid', '?')}, started "
                f"{holder.get('started', '?')}). Wait for it to finish or stop it; two pipelines must not write "
                "the same project folder.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": dt.datetime.now().isoformat(timespec="seconds")}).encode(), 0)
        os.fsync(fd)
        _held[self.lock_file] = [fd, 1]
        return self

    def __exit__(self, *exc) -> None:
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
