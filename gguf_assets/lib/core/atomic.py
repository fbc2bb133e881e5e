"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A kill -9 at any instant leaves either the old file or the new one, never a torn one,
which is what lets every stage resume from the project folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TEMP_PREFIX = ".tmp-"
OLD_SUFFIX = ".old"  # a replaced folder, kept complete until its successor is in place


def _is_full_disk(exc: BaseException) -> bool:
    """ENOSPC, also as the libraries that write for us report it: safetensors wraps it in a
    SafetensorError ("... No space left on device (os error 28)"), and gguf's writer raises a
    plain OSError("N requested and M written") for the short write."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    if "No space left on device" in text or "os error 28" in text:
        return True
    return isinstance(exc, OSError) and exc.errno is None and " requested and " in text and text.endswith(" written")


def _raise_if_full_disk(exc: BaseException, final: Path) -> None:
    """A full disk gets a message that names the file, the space left and what to do."""
    if _is_full_disk(exc):
        free = shutil.disk_usage(final.parent if final.parent.exists() else "/").free
        raise OSError(errno.ENOSPC, f"No space left on device while writing {final} ({free / 2**20:.0f} MiB "
                                    "free there). Free space on that disk and run again: the partial file was "
                                    f"removed and everything finished before it is kept. "
                                    f"({getattr(exc, 'strerror', None) or exc})") from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: Path) -> None:
    """Persist a rename: the directory entry lives in the parent folder."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE): each name then holds the other's file.
    False, with nothing changed, where the C library, the kernel or the file system cannot."""
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


@contextlib.contextmanager
def atomic_path(final: Path, *, before_replace: Callable[[], None] | None = None,
                replace: Callable[[Path, Path], None] = os.replace) -> Iterator[Path]:
    """Yield a temp path beside ``final``; on success it is fsynced and renamed over it.

    The caller (or a library such as safetensors/gguf) writes the temp path however it
    likes. On any exception the temp file is removed and ``final`` is untouched.
    ``before_replace`` runs at the last moment before the rename, and may still refuse it by raising;
    ``replace(tmp, final)`` is the rename (a caller may swap instead, and remove what it got back).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(final.name), dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # mkstemp creates 0600; give the final file the usual umask-based mode instead.
        os.chmod(tmp, 0o666 & ~_umask())
        yield tmp
        fsync_file(tmp)
        if before_replace is not None:
            before_replace()
        replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        _raise_if_full_disk(exc, final)
        raise


def write_bytes(final: Path, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def write_text(final: Path, text: str) -> None:
    write_bytes(final, text.encode("utf-8"))


def write_json(final: Path, obj: Any) -> None:
    write_text(final, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder; on success it replaces ``final`` as a whole.

    Used for checkpoints: a folder is either complete or absent.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(final.name), dir=final.parent))
    old = final.with_name(TEMP_PREFIX + final.name + OLD_SUFFIX)
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        for child in sorted(tmp.rglob("*")):  # subfolders too: open(dir, "rb") would raise
            if child.is_symlink():
                continue
            if child.is_dir():
                fsync_dir(child)
            else:
                with open(child, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():
            # Rename the old folder aside first; a kill between the two renames leaves it
            # complete under OLD_SUFFIX, and remove_stale_temps puts it back.
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir() and not final.exists():
            os.replace(old, final)
        _raise_if_full_disk(exc, final)
        raise


def temp_prefix(final_name: str) -> str:
    """The start of a temp's name beside ``final_name``: it names the writer's pid, so a cleanup can tell a temp that
    a live process is still writing (a snapshot beside a running export) from one a killed writer left."""
    return f"{TEMP_PREFIX}{final_name}.{os.getpid()}-"


_TEMP_NAME = re.compile(rf"{re.escape(TEMP_PREFIX)}(?P<final>.+)\.(?:(?P<pid>\d+)-)?[^.]+")


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temps(folder: Path, *, of: list[str] | None = None, like: Callable[[str], bool] | None = None) -> int:
    """Delete temp files/folders a killed writer left behind. Returns how many. A temp whose writer (named in its
    name, temp_prefix) still runs is left alone.

    A folder that atomic_dir had set aside is put back instead when its successor never
    took its place (not counted).

    ``of`` limits it to the temps of those final names, ``like`` to final names it accepts: for folders the user
    shares with other programs (the output folder, ``also_copy_to``).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    prefixes = tuple(f"{TEMP_PREFIX}{name}." for name in of) if of is not None else (TEMP_PREFIX,)
    removed = 0
    for child in folder.iterdir():
        if child.name.startswith(prefixes) and child.name.endswith(OLD_SUFFIX) and child.is_dir():
            final = folder / child.name[len(TEMP_PREFIX):-len(OLD_SUFFIX)]
            if not final.exists():  # killed between atomic_dir's two renames: the old one is all there is
                os.replace(child, final)
                fsync_dir(folder)
                continue
        named = _TEMP_NAME.fullmatch(child.name)
        if like is not None and not (named and like(named["final"])):
            continue
        if named and named["pid"] and _writer_alive(int(named["pid"])):
            continue
        if child.name.startswith(prefixes):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed += 1
    return removed


def sha256_file(path: Path, *, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(obj: Any) -> str:
    """A stable short hash of a JSON-able description of settings and inputs."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
