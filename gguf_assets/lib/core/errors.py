"""The base of every error that is the user's to fix (a setting, a file, the hub, the disk).

Its message already names the file, key or value and the fix, so the console shows the message
alone; anything else is a bug, and is shown with its type (the stack trace is in the run's log).

The operating system's refusals to write (a read-only folder or disk, a missing permission, a full
disk) are the user's to fix too, wherever they surface: ``os_refusal_message`` turns one into one line.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
from pathlib import Path


class UserError(Exception):
    """Raised for bad input or a broken environment; the message says what to do."""


def user_error_names() -> set[str]:
    """Class names of every UserError subclass (errors cross process boundaries as names)."""
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


# ---------------------------------------------------------------- the OS refusing a write

REFUSALS = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
# How SQLite (Dagster's storage, through SQLAlchemy) says that it may not write: it names no file.
SQLITE_REFUSALS = ("readonly database", "unable to open database file", "disk I/O error", "database or disk is full")
LOW_DISK_BYTES = 16 << 20  # below this, a disk counts as full
TEMP_PREFIX = ".tmp-"  # lib/core/atomic writes <folder>/.tmp-<name>.<random>, then renames it to <name>


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def os_refusal(exc: BaseException) -> tuple[int | None, Path | None] | None:
    """(errno, path) of the OS refusal behind ``exc`` (or its causes), None when it is none.

    An OSError with one of REFUSALS gives both (the path may be None for a write to an open file);
    SQLite's refusals give (None, None): the database is not named, ``_probe`` finds what refuses.
    """
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in REFUSALS:
            name = link.filename
            if name is None or isinstance(name, int):
                return link.errno, None
            return link.errno, Path(os.path.abspath(os.fsdecode(name)))
    for link in _chain(exc):
        module = type(link).__module__ or ""
        if (module.startswith(("sqlite3", "sqlalchemy")) and type(link).__name__ == "OperationalError"
                and any(sign in str(link) for sign in SQLITE_REFUSALS)):
            return None, None
    return None


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(_existing(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _probe(paths: list[Path]) -> tuple[int, Path] | None:
    """The first of ``paths`` (or what holds it) that this process may not write, and why."""
    for path in paths:
        there = _existing(path)
        if _read_only(there):
            return errno.EROFS, path
        if not os.access(there, os.W_OK):
            return errno.EACCES, path
        try:
            if os.statvfs(there).f_bavail * os.statvfs(there).f_frsize < LOW_DISK_BYTES:
                return errno.ENOSPC, path
        except OSError:
            pass
    return None


def _mount_point(path: Path) -> Path:
    """Where the file system holding ``path`` is mounted (bind mounts included: /proc/self/mountinfo)."""
    path = _existing(path).resolve()
    best = Path("/")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))  # \040: a space
        if (path == point or point in path.parents) and len(point.parts) > len(best.parts):
            best = point
    return best


def _shown(path: Path) -> Path:
    """A temp file of an atomic write stands for the file it was to become."""
    if path.name.startswith(TEMP_PREFIX) and "." in path.name[len(TEMP_PREFIX):]:
        return path.with_name(path.name[len(TEMP_PREFIX):].rsplit(".", 1)[0])
    return path


def _purpose(path: Path, root: Path | None) -> str:
    if root is None or not (path == root or root in path.parents):
        return ""
    rel = path.relative_to(root)
    if rel == Path(".dagster", "services.lock"):
        return " (the lock that keeps one studio and one Dagster daemon per project)"
    if rel.parts[:1] == (".dagster",):
        return " (Dagster's record of the runs)"
    if path.name.endswith(".lock"):
        return " (the project's lock)"
    if path == root:
        return " (the project folder)"
    if rel == Path("project.yaml"):
        return " (the settings)"
    return ""


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def os_refusal_message(exc: BaseException, *, project: str | Path | None, command: str) -> str | None:
    """One line for an OS refusal behind ``exc``: what refused (read-only, permission, no space), what
    ``command`` (``status``, ``auto-resume``, …) needed to write, and the fix. None when ``exc`` is not one.

    ``project`` is the project folder the command was given; SQLite's refusals name no file, so its
    Dagster storage (``.dagster``) is probed for what refuses.
    """
    from gguf_assets.lib.core.commands import trainer

    found = os_refusal(exc)
    if found is None:
        return None
    code, path = found
    if code in (errno.EACCES, errno.EPERM) and path is None:
        return None  # a refused signal or socket, not a file: not this
    root = Path(os.path.abspath(project)) if project else None
    if code is None:  # SQLite: which of the project's Dagster files may not be written?
        probed = _probe([root / ".dagster", *sorted((root / ".dagster").glob("**/*.db")), root]) if root else None
        if probed is None:
            return None
        code, path = probed
    path = _shown(path or root) if (path or root) else None
    if path is None:
        return None
    inside = root is not None and (path == root or root in path.parents)
    folder = root if inside and root.exists() else _existing(path.parent if path == root else path)
    there = _existing(path)
    verb = "read" if code == errno.EACCES and path.exists() and not os.access(path, os.R_OK) else "write"
    what = f"`gguf-trainer {command}` needs to {verb} {path}{_purpose(path, root)}"
    if command == "init" or root is None:
        elsewhere = f", or choose a folder you can write: `{trainer(command, 'NEW')}`" if command == "init" else ""
    else:
        elsewhere = (f", or copy the project to a place you can write and use the copy: `cp -a {root} NEW && "
                     f"{trainer(command, 'NEW')}`")
    if code == errno.EROFS:
        mount = _mount_point(path)
        return (f"{folder} is read-only (its file system is mounted read-only at {mount}), and {what}. Remount "
                f"{mount} read-write{elsewhere}.")
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = os.statvfs(there).f_bavail * os.statvfs(there).f_frsize / 2**20
        quota = "; or your disk quota is used up" if code == errno.EDQUOT else ""
        kept = "" if command == "init" else ": everything finished so far is kept"
        return (f"No space left on the disk holding {folder} ({free:.0f} MiB free{quota}), and {what}. Free some "
                f"space (or move the project to a bigger disk), then run the command again{kept}.")
    user, st = _name_of(os.geteuid()), there.stat()
    if code == errno.EPERM:
        return (f"Operation not permitted on {there}, and {what}. If `lsattr -d {there}` shows i (immutable) or a "
                f"(append-only), `chattr -i -a {there}` as root lifts that; else make it writable for {user}"
                f"{elsewhere}.")
    if verb == "read":
        return (f"Permission denied: {there} ({stat.filemode(st.st_mode)}, owner {_name_of(st.st_uid)}) may not be "
                f"read by {user}, and {what}. Make it readable for {user} (`chmod -R u+r {there}` as its owner, or "
                f"`chown -R {user} {there}` as root).")
    return (f"Permission denied: {there} ({stat.filemode(st.st_mode)}, owner {_name_of(st.st_uid)}) may not be "
            f"written by {user}, and {what}. Make it writable for {user} (`chmod -R u+w {folder}` as its owner, or "
            f"`chown -R {user} {folder}` as root){elsewhere}.")


class ProjectNotWritable(UserError):
    """A command that writes the project (`run`), refused before it starts: the folder is read-only."""


def write_refusal(project: str | Path, needs: list[Path], *, command: str) -> str | None:
    """``os_refusal_message``'s line when the first of ``needs`` (what ``command`` writes first, in the project
    folder ``project``) may not be written: its file system is mounted read-only, or this user lacks the
    permission. None when it may (a full disk is left to the write that meets it)."""
    probed = _probe(needs)
    if probed is None or probed[0] not in (errno.EROFS, errno.EACCES):
        return None
    code, path = probed
    return os_refusal_message(OSError(code, os.strerror(code), str(path)), project=project, command=command)
