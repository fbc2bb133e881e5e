"""Tests for the one-pipeline-per-project flock (gguf_assets.lib.core.lock)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gguf_assets.lib.core.lock import ProjectLock, ProjectLocked

# A child process that takes the lock, says so, then waits for a line on stdin (or is killed).
HOLDER = textwrap.dedent("""
    import sys
    from gguf_assets.lib.core.lock import ProjectLock
    with ProjectLock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.readline()
    print("released", flush=True)
""")

# A child process that tries to take the lock once and reports what happened.
TRY = textwrap.dedent("""
    import sys
    from gguf_assets.lib.core.lock import ProjectLock, ProjectLocked
    try:
        with ProjectLock(sys.argv[1]):
            print("acquired", flush=True)
    except ProjectLocked as exc:
        print("refused:", exc, flush=True)
""")


def _start_holder(lock_file: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "locked":
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail(f"holder process did not take the lock (said {line!r})")
    return proc


def _try_in_child(lock_file: Path) -> str:
    done = subprocess.run([sys.executable, "-c", TRY, str(lock_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def lock_file(tmp_path) -> Path:
    return tmp_path / "project" / ".pipeline.lock"


def test_lock_held_by_another_process_is_refused_naming_its_pid(lock_file):
    holder = _start_holder(lock_file)
    try:
        with pytest.raises(ProjectLocked) as info:
            with ProjectLock(lock_file):
                pytest.fail("took a lock another process holds")
        msg = str(info.value)
        assert f"pid {holder.pid}" in msg
        assert str(lock_file.parent) in msg
        assert json.loads(lock_file.read_text())["pid"] == holder.pid
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        holder.wait(timeout=10)
    # Released cleanly: now this process gets it, and writes its own pid.
    with ProjectLock(lock_file):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()


def test_lock_held_here_refuses_another_process(lock_file):
    with ProjectLock(lock_file):
        out = _try_in_child(lock_file)
        assert out.startswith("refused:") and f"pid {os.getpid()}" in out
    assert _try_in_child(lock_file) == "acquired"


def test_reentry_in_the_same_process_nests(lock_file):
    outer = ProjectLock(lock_file)
    with outer:
        with ProjectLock(lock_file):  # a second object on the same file (e.g. an asset step inside `run`)
            with ProjectLock(lock_file.parent / "." / lock_file.name):  # same file, other spelling
                assert _try_in_child(lock_file).startswith("refused:")
            assert _try_in_child(lock_file).startswith("refused:")
        # The inner exits must not have released the outer hold.
        assert _try_in_child(lock_file).startswith("refused:")
    assert _try_in_child(lock_file) == "acquired"


def test_lock_can_be_taken_again_after_release(lock_file):
    for _ in range(3):
        with ProjectLock(lock_file):
            pass
    with ProjectLock(lock_file):
        assert _try_in_child(lock_file).startswith("refused:")


def test_lock_of_a_killed_process_is_taken_over(lock_file):
    holder = _start_holder(lock_file)
    os.kill(holder.pid, signal.SIGKILL)
    assert holder.wait(timeout=10) == -signal.SIGKILL
    holder.stdout.close()
    holder.stdin.close()
    assert json.loads(lock_file.read_text())["pid"] == holder.pid  # the dead holder's record is left behind
    with ProjectLock(lock_file):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()


def test_different_projects_do_not_block_each_other(tmp_path):
    a, b = tmp_path / "a" / ".pipeline.lock", tmp_path / "b" / ".pipeline.lock"
    holder = _start_holder(a)
    try:
        with ProjectLock(b):
            assert b.is_file()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()
        holder.stdin.close()


# A child that joins the lock as a worker of the given leader pid.
JOIN = textwrap.dedent("""
    import sys
    from gguf_assets.lib.core.lock import ProjectLock, ProjectLocked
    try:
        with ProjectLock(sys.argv[1], leader_pid=int(sys.argv[2])) as lock:
            print("shared with", lock.shared_with, flush=True)
    except ProjectLocked as exc:
        print("refused:", exc, flush=True)
""")


def test_a_worker_shares_the_lock_only_with_its_own_ancestor(lock_file):
    """--workers: a run naming the holder's pid shares its lock if the holder is its ancestor;
    naming another pid, or holding no such ancestry, is refused."""
    with ProjectLock(lock_file, describe="gguf-trainer run demo"):
        joined = subprocess.run([sys.executable, "-c", JOIN, str(lock_file), str(os.getpid())],
                                capture_output=True, text=True, timeout=60)
        assert joined.stdout.strip() == f"shared with {os.getpid()}", joined.stderr
        wrong = subprocess.run([sys.executable, "-c", JOIN, str(lock_file), str(os.getppid())],
                               capture_output=True, text=True, timeout=60)
        assert wrong.stdout.startswith("refused:") and "gguf-trainer run demo" in wrong.stdout
    holder = _start_holder(lock_file)
    try:
        # Not an ancestor: naming the holder's pid is not enough.
        forged = subprocess.run([sys.executable, "-c", JOIN, str(lock_file), str(holder.pid)],
                                capture_output=True, text=True, timeout=60)
        assert forged.stdout.startswith("refused:") and f"pid {holder.pid}" in forged.stdout
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)


# A worker of the given leader that joins, says so, then keeps writing until a line on stdin.
WORKER = textwrap.dedent("""
    import sys
    from gguf_assets.lib.core.lock import ProjectLock, ProjectLocked
    try:
        with ProjectLock(sys.argv[1], leader_pid=int(sys.argv[2])) as lock:
            print("joined", lock.shared_with, flush=True)
            sys.stdin.readline()
    except ProjectLocked as exc:
        print("refused:", exc, flush=True)
""")


def test_a_worker_outliving_its_leader_still_holds_the_folder(lock_file):
    """The leader goes first (a kill -9 of `gguf-trainer run`): its worker keeps a lock of its own, so a new
    pipeline is refused until the worker is done; a worker that starts after its leader is gone is refused."""
    with ProjectLock(lock_file, describe="gguf-trainer run demo"):
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(lock_file), str(os.getpid())],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == f"joined {os.getpid()}"
    try:
        refused = _try_in_child(lock_file)
        assert refused.startswith("refused:") and "worker runs of an earlier pipeline" in refused, refused
        assert "gguf-trainer run demo" in refused  # the earlier pipeline is named
        late = subprocess.run([sys.executable, "-c", JOIN, str(lock_file), str(os.getpid())],
                              capture_output=True, text=True, timeout=60)
        assert late.stdout.startswith("refused:") and "is gone" in late.stdout, late.stdout + late.stderr
    finally:
        worker.stdin.write("\n")
        worker.stdin.flush()
        worker.wait(timeout=30)
    assert _try_in_child(lock_file) == "acquired"


def test_the_holder_record_names_the_run_a_nested_taker_executes(lock_file):
    """`status` reads which run works on the folder: a run taking the lock inside `gguf-trainer run` records
    itself while it holds it, and the pipeline's own record is back once it leaves."""
    from gguf_assets.lib.core.lock import RunningRun, holder

    assert holder(lock_file) is None
    with ProjectLock(lock_file, describe="gguf-trainer run demo"):
        assert holder(lock_file).what == "gguf-trainer run demo" and holder(lock_file).running is None
        assert list(json.loads(lock_file.read_text())) == ["pid", "started", "what"]  # the keys of every version
        running = RunningRun(run_id="1a2b3c4d5e", job="train_export_evaluate", assets=("adapter", "gguf"))
        with ProjectLock(lock_file, describe="Dagster run 1a2b3c4d", running=running):
            assert holder(lock_file).running == running
            assert holder(lock_file).pid == os.getpid()
            assert json.loads(lock_file.read_text())["running"] == {
                "run_id": "1a2b3c4d5e", "job": "train_export_evaluate", "assets": ["adapter", "gguf"]}
        assert holder(lock_file).running is None and "running" not in json.loads(lock_file.read_text())
    assert holder(lock_file) is None


def test_a_holder_record_of_the_old_dict_shape_reads_and_writes_the_same_json():
    """The record is JSON in the lock file: what an earlier version wrote reads into the typed record (unknown keys
    ignored, missing or malformed ones unknown), and the record writes back the same keys in the same order."""
    from gguf_assets.lib.core.lock import HolderRecord, RunningRun

    old = {"pid": 12, "started": "2026-12-01T09:00:00", "what": "Dagster run 1a2b3c4d of all_stages",
           "running": {"run_id": "1a2b3c4d5e", "job": "all_stages", "assets": ["materials", "corpus"]}}
    record = HolderRecord.from_json(old)
    assert record == HolderRecord(pid=12, started="2026-12-01T09:00:00", what="Dagster run 1a2b3c4d of all_stages",
                                  running=RunningRun("1a2b3c4d5e", "all_stages", ("materials", "corpus")))
    assert json.dumps(record.to_json()) == json.dumps(old)
    services = {"pid": 7, "started": "2026-12-01T09:00:00", "urls": {"studio": "http://h:1", "Dagster UI": "http://h:2"}}
    assert json.dumps(HolderRecord.from_json(services).to_json()) == json.dumps(services)
    assert HolderRecord.from_json({"urls": {}}).to_json() == {"urls": {}}  # auto-resume's daemon-only record
    newer = HolderRecord.from_json({**old, "host": "node-3", "running": {**old["running"], "queued": 2}})
    assert newer == record  # keys of a later version are ignored
    assert HolderRecord.from_json({}) == HolderRecord() and HolderRecord().to_json() == {}
    assert HolderRecord.from_json(["not", "a", "record"]) == HolderRecord()
    assert HolderRecord.from_json({"pid": "x", "running": {}}) == HolderRecord()  # malformed: unknown, no run
    assert RunningRun.from_json({"run_id": "abc"}) == RunningRun("abc", "", ())  # an old run without assets


def test_the_services_lock_names_the_open_servers(tmp_path):
    """A second `ui` is refused with the URLs and pid from the first one's record."""
    from gguf_assets.lib.core.lock import hold_services

    lock_file = tmp_path / "project" / ".dagster" / "services.lock"
    fd = hold_services(lock_file, {"studio": "http://127.0.0.1:3001", "Dagster UI": "http://127.0.0.1:3000"})
    try:
        record = json.loads(lock_file.read_text())
        assert list(record) == ["pid", "started", "urls"] and record["pid"] == os.getpid()
        assert record["urls"] == {"studio": "http://127.0.0.1:3001", "Dagster UI": "http://127.0.0.1:3000"}
        refused = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom gguf_assets.lib.core.lock import ServicesOpen, hold_services\n"
             "try:\n    hold_services(sys.argv[1], {})\nexcept ServicesOpen as exc:\n    print(exc)",
             str(lock_file)], capture_output=True, text=True, timeout=60)
        said = refused.stdout
        assert said.startswith(f"{tmp_path / 'project'} is already open (studio http://127.0.0.1:3001, Dagster UI "
                               f"http://127.0.0.1:3000; pid {os.getpid()}, since {record['started']})."), said
    finally:
        os.close(fd)


# A cluster run (no descendant of the leader) that joins when admitted, then writes until a line on stdin.
ADMITTED = textwrap.dedent("""
    import sys
    from gguf_assets.lib.core.lock import ProjectLock, ProjectLocked
    try:
        with ProjectLock(sys.argv[1], admitted_run=sys.argv[2]) as lock:
            print("joined", lock.shared_with, flush=True)
            sys.stdin.readline()
    except ProjectLocked as exc:
        print("refused:", exc, flush=True)
""")


def _admitted_run(lock_file: Path, run_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ADMITTED, str(lock_file), run_id], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=30)


def test_cluster_runs_join_only_when_admitted_and_survive_their_leader_until_a_new_pipeline(lock_file):
    """A run on a cluster worker joins the pipeline that admitted its id, also after that pipeline has stopped
    following; while it writes, a new pipeline is refused; a new pipeline ends the earlier admissions, so a run
    queued by the earlier one and started later stops before writing."""
    from gguf_assets.lib.core.lock import admit_runs, admitted_file

    with pytest.raises(RuntimeError, match="only the holder"):
        admit_runs(lock_file, ["run-x"])
    with ProjectLock(lock_file, describe="gguf-trainer run demo"):
        admit_runs(lock_file, ["run-a", "run-b", "run-late"])
        first = _admitted_run(lock_file, "run-a")
        assert first.stdout.readline().strip() == "joined admitted"
        stranger = _admitted_run(lock_file, "run-z")
        said = stranger.stdout.readline()
        stranger.wait(timeout=30)
        assert said.startswith("refused: run run-z is not admitted"), said
    try:  # the leader stopped following: an admitted run still joins, and the folder is still in use
        second = _admitted_run(lock_file, "run-b")
        assert second.stdout.readline().strip() == "joined admitted"
        refused = _try_in_child(lock_file)
        assert refused.startswith("refused:") and "worker runs of an earlier pipeline" in refused, refused
    finally:
        _finish(first)
        _finish(second)
    # A new pipeline takes over and ends the earlier admissions: the late run of the earlier one is refused.
    with ProjectLock(lock_file, describe="gguf-trainer run demo, again"):
        assert not admitted_file(lock_file).exists()
        late = _admitted_run(lock_file, "run-late")
        said = late.stdout.readline()
        late.wait(timeout=30)
        assert said.startswith("refused: run run-late is not admitted") and "an earlier one" in said, said


def test_who_holds_the_lock_is_asked_without_writing_so_a_read_only_project_answers(lock_file, monkeypatch):
    """`status` asks who holds the lock: on a folder mounted read-only no lock file opens for writing (EROFS, which
    refuses root too), yet a holder and a worker still writing are told; a lock file this user may not open at
    all (another user's 0600 one) is no holder known, not an error."""
    import errno
    import fcntl

    from gguf_assets.lib.core import lock

    lock_file.parent.mkdir(parents=True)
    real_open, refused = os.open, {}

    def mounted_read_only(path, flags, *args, **kw):
        if Path(path).parent == lock_file.parent.resolve() and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            refused[Path(path).name] = True
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kw)

    holder_proc = _start_holder(lock_file)
    try:
        monkeypatch.setattr(lock.os, "open", mounted_read_only)
        record = lock.holder(lock_file)
        assert record is not None and record.pid == holder_proc.pid
    finally:
        monkeypatch.undo()
        holder_proc.stdin.write("\n")
        holder_proc.stdin.flush()
        holder_proc.wait(timeout=30)
    workers = real_open(lock.workers_file(lock_file), os.O_RDWR | os.O_CREAT, 0o600)  # a worker still writing
    fcntl.flock(workers, fcntl.LOCK_SH)
    try:
        monkeypatch.setattr(lock.os, "open", mounted_read_only)
        assert lock.is_locked(lock_file)  # told through a read-only open of the workers file
        assert refused == {lock.workers_file(lock_file).name: True}  # it tried to write, and was refused
    finally:
        monkeypatch.undo()
        os.close(workers)
    assert not lock.is_locked(lock_file)

    def not_ours(path, flags, *args, **kw):
        if Path(path).parent == lock_file.parent.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(lock.os, "open", not_ours)
    assert lock.holder(lock_file) is None and not lock.is_locked(lock_file)
