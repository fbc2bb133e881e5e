"""One pipeline per project folder: an flock on <project>/.pipeline.lock.

The kernel drops an flock when its holder dies, so a lock left by a killed process is
taken over without any guessing about stale pids; the pid, start time and Dagster run
written into the file are only there to tell the user who holds it.

A worker of the holder's own pipeline (a Dagster run that `gguf-trainer run --workers N`
launched through the run launcher) joins its pipeline when it names the holder's pid and that
process is one of its ancestors. Nothing secret is written anywhere; an unrelated process,
or any other descendant (a run launched from a UI that the holder started), is refused.

A worker holds a lock of its own, a shared flock on <project>/.pipeline.workers.lock, for as
long as it writes: its leader may die first (a kill -9 of `gguf-trainer run` leaves the worker
runs computing under their code server), and a new pipeline must then be refused until the last
worker is done, or two teachers would run at once. A new pipeline takes that file exclusively
for a moment, which only succeeds once no worker of an earlier one holds it.

On a cluster (docs/cluster.md) the runs execute on Celery workers, which are no descendants of the
leader and may start after it has stopped following them. There the leader *admits* the runs it
launched: it lists their run ids in <project>/.pipeline.admitted.json while it holds the lock, and a
run whose id is listed joins, holding the shared workers lock as above. A new pipeline clears the
list inside its exclusive moment on the workers file, so a run admitted by an earlier pipeline
either still writes (and the new pipeline is refused) or finds itself no longer admitted and stops
before writing: its shards are the new pipeline's to plan.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from gguf_assets.lib.core.errors import UserError


class ProjectLocked(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class RunningRun:
    """The Dagster run that works on the project now: its id, its job and the assets it materializes."""

    run_id: str
    job: str
    assets: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "job": self.job, "assets": list(self.assets)}

    @classmethod
    def from_json(cls, data: object) -> RunningRun | None:
        """None for anything that names no run (absent, empty, not an object)."""
        if not isinstance(data, dict) or not data.get("run_id"):
            return None
        return cls(run_id=str(data["run_id"]), job=str(data.get("job", "")),
                   assets=tuple(str(a) for a in data.get("assets") or ()))


@dataclass(frozen=True)
class HolderRecord:
    """Who holds a lock file, as written into it (JSON): the project lock's {pid, started, what[, running]}, the
    services lock's {pid, started, urls}.

    A field the file does not have stays None and is left out when written, so the JSON keeps the keys (and their
    order) that earlier versions wrote; a record written by an older or newer version reads, unknown keys ignored.
    """

    pid: int | None = None
    started: str | None = None  # ISO time, seconds
    what: str | None = None  # the project lock: the pipeline, in words ("gguf-trainer run demo")
    running: RunningRun | None = None  # the project lock: the Dagster run executing now (``ProjectLock.running``)
    urls: tuple[tuple[str, str], ...] | None = None  # the services lock: (name, URL) of each server started

    def to_json(self) -> dict:
        data: dict = {}
        if self.pid is not None:
            data["pid"] = self.pid
        if self.started is not None:
            data["started"] = self.started
        if self.what is not None:
            data["what"] = self.what
        if self.running is not None:
            data["running"] = self.running.to_json()
        if self.urls is not None:
            data["urls"] = dict(self.urls)
        return data

    @classmethod
    def from_json(cls, data: object) -> HolderRecord:
        """The record in ``data`` (a JSON object); what is missing or malformed in it reads as unknown (None)."""
        if not isinstance(data, dict):
            return cls()
        try:
            pid = int(data["pid"]) if data.get("pid") is not None else None
        except (TypeError, ValueError):
            pid = None
        started, what, urls = data.get("started"), data.get("what"), data.get("urls")
        return cls(pid=pid, started=None if started is None else str(started),
                   what=None if what is None else str(what), running=RunningRun.from_json(data.get("running")),
                   urls=tuple((str(k), str(v)) for k, v in urls.items()) if isinstance(urls, dict) else None)


WORKERS_SUFFIX = ".workers"  # .pipeline.lock -> .pipeline.workers.lock
ADMITTED_SUFFIX = ".admitted.json"  # .pipeline.lock -> .pipeline.admitted.json


def workers_file(lock_file: Path) -> Path:
    return lock_file.with_name(lock_file.stem + WORKERS_SUFFIX + lock_file.suffix)


def admitted_file(lock_file: Path) -> Path:
    return lock_file.with_name(lock_file.stem + ADMITTED_SUFFIX)


def _admitted(lock_file: Path) -> set[str]:
    try:
        return set(json.loads(admitted_file(lock_file).read_text()).get("runs", []))
    except (OSError, ValueError, AttributeError):
        return set()


def admit_runs(lock_file: Path, run_ids: list[str]) -> None:
    """Let these runs (launched to a cluster's workers) join the pipeline this process leads."""
    lock_file = Path(lock_file).resolve()
    if lock_file not in _held:
        raise RuntimeError(f"only the holder of {lock_file} may admit runs to its pipeline")
    from gguf_assets.lib.core import atomic

    atomic.write_json(admitted_file(lock_file), {"runs": sorted(_admitted(lock_file) | set(run_ids))})


# Lock files this process holds, with a nesting count: the CLI holds the lock for a whole
# `run`, and each Dagster run (which may execute in that same process) takes it again; the
# records the nested takers replaced, to put back when they leave.
_held: dict[Path, list] = {}  # path -> [fd, nesting count, [HolderRecord replaced]]


def _is_ancestor(pid: int) -> bool:
    try:
        return any(parent.pid == pid for parent in psutil.Process().parents())
    except psutil.Error:
        return False


class ProjectLock:
    """Exclusive lock on a project folder; ``describe`` is shown to whoever is refused (e.g. the run).

    ``running`` says which Dagster run executes now; `status` reads it
    (``holder``) to show those stages as running. A nested taker in the same process (the run
    inside `gguf-trainer run`) records its own while it holds the lock.
    """

    def __init__(self, lock_file: Path, *, describe: str = "", leader_pid: int | None = None,
                 running: RunningRun | None = None, admitted_run: str | None = None) -> None:
        self.lock_file = Path(lock_file).resolve()
        self.describe = describe
        self.leader_pid = leader_pid
        self.admitted_run = admitted_run  # a cluster run: it joins the pipeline that admitted it, or stops
        self.running = running
        self.shared_with: int | str | None = None  # the ancestor pid whose pipeline this process joined
        self._worker_fd: int | None = None  # the shared flock a worker holds on the workers file

    def __enter__(self) -> "ProjectLock":
        if self.admitted_run is not None:
            return self._join_as_admitted()
        if self.lock_file in _held:
            entry = _held[self.lock_file]
            entry[1] += 1
            previous = _read_holder(entry[0])
            entry[2].append(previous)
            if self.running is not None:
                _write_holder(entry[0], dataclasses.replace(previous, running=self.running))
            return self
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            pid = holder.pid if holder.pid is not None else -1
            if pid > 0 and pid == self.leader_pid and _is_ancestor(pid):
                self._worker_fd = _flock(workers_file(self.lock_file), fcntl.LOCK_SH)
                if self._worker_fd is not None:
                    self.shared_with = pid
                    return self
            raise ProjectLocked(
                f"{self.lock_file.parent} is in use by another pipeline ({_who(holder)}). Wait for it to finish or "
                "stop it; two pipelines must not write the same project folder.") from None
        if self.leader_pid is not None:  # a worker whose leader is gone never leads a pipeline of its own
            os.close(fd)
            raise ProjectLocked(
                f"the pipeline that launched this worker run (pid {self.leader_pid}) is gone, so the run stops "
                f"before writing {self.lock_file.parent}; `gguf-trainer run` continues the work.")
        if _workers_still_write(self.lock_file, new_pipeline=True):  # workers of an earlier, gone pipeline
            earlier = _read_holder(fd)
            os.close(fd)
            raise ProjectLocked(
                f"{self.lock_file.parent} is still written by the worker runs of an earlier pipeline "
                f"({_who(earlier)}), which is gone. Wait for them to finish (they keep their shards), or stop them "
                "with Terminate in the Dagster UI; two pipelines must not write the same project folder.")
        _write_holder(fd, HolderRecord(pid=os.getpid(), started=_now(), what=self.describe, running=self.running))
        _held[self.lock_file] = [fd, 1, []]
        return self

    def _join_as_admitted(self) -> "ProjectLock":
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(50):  # a new pipeline holds the workers file exclusively for a moment only
            self._worker_fd = _flock(workers_file(self.lock_file), fcntl.LOCK_SH)
            if self._worker_fd is not None:
                break
            time.sleep(0.1)
        else:
            raise ProjectLocked(f"{self.lock_file.parent}: a new pipeline is starting; this run stops before "
                                "writing, and that pipeline plans its work.")
        if self.admitted_run not in _admitted(self.lock_file):  # read under the shared lock: see the docstring
            fcntl.flock(self._worker_fd, fcntl.LOCK_UN)
            os.close(self._worker_fd)
            self._worker_fd = None
            raise ProjectLocked(
                f"run {self.admitted_run[:8]} is not admitted to the pipeline of {self.lock_file.parent} (an earlier "
                "one launched it, or another program), so it stops before writing; `gguf-trainer run` plans its "
                "work again.")
        self.shared_with = "admitted"
        return self

    def __exit__(self, *exc) -> None:
        if self.shared_with is not None:
            if self._worker_fd is not None:
                fcntl.flock(self._worker_fd, fcntl.LOCK_UN)
                os.close(self._worker_fd)
                self._worker_fd = None
            return
        entry = _held.get(self.lock_file)
        if entry is None:
            return
        entry[1] -= 1
        if entry[2]:
            _write_holder(entry[0], entry[2].pop())
        if entry[1] == 0:
            del _held[self.lock_file]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


def _flock(path: Path, mode: int) -> int | None:
    """An open fd holding ``mode`` (shared or exclusive) on ``path``, or None if that is held otherwise now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _workers_still_write(lock_file: Path, *, new_pipeline: bool = False) -> bool:
    """Whether some worker holds its shared lock; takes the workers file exclusively only for a moment
    (this pipeline's own workers take it shared after that). A ``new_pipeline`` ends the admissions of
    the earlier one in that moment (see the module docstring)."""
    if not new_pipeline and not workers_file(lock_file).is_file():  # a new pipeline creates it: no race
        return False
    if not new_pipeline:  # a question only (`status`, the studio): asked on a read-only project folder too
        return _held_by_another(workers_file(lock_file))
    workers = _flock(workers_file(lock_file), fcntl.LOCK_EX)
    if workers is None:
        return True
    if new_pipeline:
        admitted_file(lock_file).unlink(missing_ok=True)
    fcntl.flock(workers, fcntl.LOCK_UN)
    os.close(workers)
    return False


def _open_to_look(path: Path, *, exclusive: bool = False) -> int | None:
    """``path`` opened to take an flock on it for a moment, without creating it: for writing where that is allowed
    (an exclusive flock over NFS needs it), else read-only (flock itself needs no write access), so the questions
    below work on a project folder mounted read-only or of another user too, where they only read. None when the
    file is not there, or may not be opened at all (another user's 0600 lock): then nobody is known to hold it."""
    for mode in ((os.O_RDWR, os.O_RDONLY) if exclusive else (os.O_RDONLY,)):
        try:
            return os.open(path, mode)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
    return None


def _held_by_another(path: Path) -> bool:
    """Whether another open file holds an flock (shared or exclusive) on ``path`` now; takes it for a moment only.
    False when that cannot be told (the file may not be opened, or not locked so over a network file system)."""
    fd = _open_to_look(path, exclusive=True)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:  # EBADF: an NFS flock (a byte-range lock there) of a read-only file cannot be exclusive
        return False
    finally:
        os.close(fd)


def _now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def _known(value: object) -> object:
    return "?" if value is None else value


def _who(record: HolderRecord) -> str:
    """A holder record in the words of a refusal: "pid 12, started 2026-12-01T09:00:00, gguf-trainer run demo"."""
    what = f", {record.what}" if record.what else ""
    return f"pid {_known(record.pid)}, started {_known(record.started)}{what}"


def is_locked(lock_file: Path) -> bool:
    """True while some process holds the lock (this one included), or a worker still writes; takes nothing."""
    lock_file = Path(lock_file).resolve()
    if lock_file in _held:
        return True
    if _workers_still_write(lock_file):
        return True
    fd = _open_to_look(lock_file)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def holder(lock_file: Path) -> HolderRecord | None:
    """Who holds the lock now (pid, started, what[, running]), or None when nobody does."""
    if not is_locked(lock_file):
        return None
    fd = _open_to_look(Path(lock_file).resolve())
    if fd is None:
        return None
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _write_holder(fd: int, record: HolderRecord) -> None:
    data = json.dumps(record.to_json()).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _read_holder(fd: int) -> HolderRecord:
    try:
        return HolderRecord.from_json(json.loads(os.pread(fd, 4096, 0).decode() or "{}"))
    except (OSError, ValueError):
        return HolderRecord()


class ServicesOpen(UserError):
    """The project's servers (studio, Dagster UI, daemon) are already running."""


def hold_services(lock_file: Path, urls: Mapping[str, str]) -> int:
    """One set of servers per project: an exclusive flock on ``lock_file`` with a record of this pid and the
    ``urls`` ({name: URL} of the servers) in it.

    Returns the open fd: hand it to every server started (``pass_fds``), so the lock stays held for as long as
    any of them runs, also after a kill -9 of the process that started them; a second `ui` is then refused
    instead of starting a second dagster-daemon on the same instance. ServicesOpen (naming the open one's URLs
    and pid) when it is held."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = _read_holder(fd)
        os.close(fd)
        alive = psutil.pid_exists(other.pid if other.pid is not None else -1)
        named = ", ".join(f"{name} {url}" for name, url in other.urls or ()) or "its URLs unknown"
        who = (f"pid {_known(other.pid)}" if alive else
               f"started by pid {_known(other.pid)}, which is gone while its servers still run")
        raise ServicesOpen(
            f"{lock_file.parent.parent} is already open ({named}; {who}, since {_known(other.started)}). "
            "Open those pages, or stop that `gguf-trainer ui` first (Ctrl-C in its terminal); one project runs "
            "one studio and one Dagster daemon.") from None
    _write_holder(fd, HolderRecord(pid=os.getpid(), started=_now(), urls=tuple(urls.items())))
    return fd
