"""Is a reused file still what was written? Cheaply by its stamp; fully where it is read anyway.

Every file a stage writes and a later stage reuses (shard halves, corpus splits, checkpoints,
the exported GGUF) gets a record: its size, mtime, inode and sha256. Two checks use it:

- ``unchanged(path, record)`` is what `status` and the planner ask. A different size means
  changed, at once. The same size, mtime and inode mean unchanged, without reading a byte, so
  `status` costs the same for 10 shards or 10,000. Anything in between (a copied project has
  new inodes, a restored backup new mtimes) is settled by the content, read once.
- ``ContentCheck`` hashes the bytes as a reader consumes them and compares at the end. Readers
  that load a whole file anyway (training, evaluation, export) use it, so nothing corrupt is
  used and nothing is read twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError

STAMP_KEYS = ("bytes", "mtime_ns", "inode")


class CorruptFile(UserError, ValueError):
    """A file's content differs from what was recorded when it was written."""


def stamp(path: Path) -> dict[str, int]:
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def record(path: Path, sha256: str | None = None) -> dict:
    """What to store beside a file just written: its stamp and its sha256 (computed if not given)."""
    return {**stamp(path), "sha256": sha256 if sha256 is not None else atomic.sha256_file(path)}


def without_stamp(entry: dict) -> dict:
    """An entry as users read it (size and sha256 stay): the mtime and inode are only for ``stamp_matches``."""
    return {k: v for k, v in entry.items() if k not in ("mtime_ns", "inode")}


def stamp_matches(path: Path, recorded: dict) -> bool | None:
    """True: same stamp. False: gone or another size. None: same size, other mtime or inode (or no stamp)."""
    try:
        now = stamp(path)
    except OSError:
        return False
    if recorded.get("bytes") != now["bytes"]:
        return False
    if all(recorded.get(k) == now[k] for k in STAMP_KEYS):
        return True
    return None


def unchanged(path: Path, recorded: dict) -> bool:
    """Whether ``path`` still holds what ``recorded`` describes; reads the file only when its stamp is unsure."""
    return confirmed(path, recorded) is not None


def confirmed(path: Path, recorded: dict) -> dict | None:
    """The record of ``path`` if it still holds what ``recorded`` describes, else None.

    When the content had to settle it, the returned record carries the new stamp: storing it
    (``refreshed``) makes the next check cheap again, as in a project copied with new inodes.
    """
    matches = stamp_matches(path, recorded)
    if matches is None:
        if recorded.get("sha256") is None or atomic.sha256_file(path) != recorded["sha256"]:
            return None
        return {**recorded, **stamp(path)}
    return recorded if matches else None


def refreshed(recorded: dict, now: dict) -> bool:
    """Whether ``now`` (from ``confirmed``) carries a newer stamp than the stored ``recorded``."""
    return any(recorded.get(k) != now.get(k) for k in STAMP_KEYS)


def store_refreshed(record_file: Path, stored: Any, updated: Any) -> None:
    """Write ``updated`` (records from ``confirmed``) over ``stored`` when a stamp changed, so the
    next check costs no read again. Best effort: a read-only copy is checked by content next time."""
    if updated != stored:
        with contextlib.suppress(OSError):
            atomic.write_json(record_file, updated)


class ContentCheck:
    """Hash bytes as a reader consumes them; ``finish`` raises CorruptFile when they differ from the record."""

    def __init__(self, path: Path, expected_sha256: str | None) -> None:
        self.path, self.expected = path, expected_sha256
        self._digest = hashlib.sha256() if expected_sha256 else None

    def update(self, chunk) -> None:
        if self._digest is not None:
            self._digest.update(chunk)

    def finish(self, *, what_to_do: str = "") -> None:
        if self._digest is not None and self._digest.hexdigest() != self.expected:
            raise CorruptFile(f"{self.path}: its content differs from what was written (sha256 "
                              f"{self._digest.hexdigest()[:12]}…, recorded {self.expected[:12]}…). "
                              f"{what_to_do}".rstrip())


def read_checked(path: Path, expected_sha256: str | None, *, what_to_do: str) -> bytes:
    """A small file's bytes, after checking them against the recorded sha256 (if any)."""
    data = Path(path).read_bytes()
    check = ContentCheck(path, expected_sha256)
    check.update(data)
    check.finish(what_to_do=what_to_do)
    return data
