"""Real servers for the cluster tests, started on loopback in temp folders: PostgreSQL and Redis (Debian's
packages).

Postgres refuses to run as root, so as root the server runs as a system user made for it
(`gguf_pg`). Where the server binaries are missing (a developer's laptop) the tests are skipped with
the reason; in CI (`CI` set, and `.ci/run` installs them with apt) that is a failure instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_USER = "gguf_pg"  # the system user the server runs as when the tests run as root
OPTIONS_FILE = "server.options"  # the server's command-line options, in its folder


def _unavailable(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}; CI must install it (see .ci/run)")
    pytest.skip(f"{what} (CI installs it with apt)")


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        _unavailable(f"PostgreSQL's {name} is not installed")
    return found


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    if subprocess.run(["id", "-u", PG_USER], capture_output=True).returncode != 0:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
                              capture_output=True, text=True)
        # Two test processes may make it at once (pytest -n 2): the user existing afterwards is what counts.
        if made.returncode != 0 and subprocess.run(["id", "-u", PG_USER], capture_output=True).returncode != 0:
            raise RuntimeError(f"could not make the user {PG_USER}: {made.stderr.strip()}")
    return ["runuser", "-u", PG_USER, "--", *command]


@contextlib.contextmanager
def postgres_server(folder: Path, port: int) -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1:``port`` with its data in ``folder``; yields the URL of a database.

    ``folder`` is a link to a folder of its own under /tmp: pytest makes its base folder private (0700) at every
    session start, which would cut a server running as another user off from its data mid-run."""
    initdb, pg_ctl, createdb = _pg_bin("initdb"), _pg_bin("pg_ctl"), _pg_bin("createdb")
    real = Path(tempfile.mkdtemp(prefix="gguf-pg-"))
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.symlink_to(real, target_is_directory=True)
    folder = real
    data, sockets = folder / "data", folder / "sockets"
    data.mkdir(parents=True)
    sockets.mkdir()
    if os.geteuid() == 0:
        _as_server_user(["true"])  # makes the user
        for path in (folder, data, sockets):
            shutil.chown(path, PG_USER)
        os.chmod(folder, 0o755)
        for parent in folder.parents:  # the server user must be able to reach its folder
            if parent.stat().st_mode & 0o001 == 0:
                os.chmod(parent, parent.stat().st_mode | 0o001)
    def run(*command: str) -> None:
        subprocess.run(_as_server_user(list(command)), check=True, capture_output=True, text=True)

    run(initdb, "-D", str(data), "-A", "trust", "-U", "gguf", "--no-sync")
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
    (folder / OPTIONS_FILE).write_text(options)  # for start_postgres after a stop_postgres
    run(pg_ctl, "-D", str(data), "-o", options, "-l", str(folder / "server.log"), "-w", "start")
    try:
        run(createdb, "-h", "127.0.0.1", "-p", str(port), "-U", "gguf", "dagster")
        yield f"postgresql://gguf@127.0.0.1:{port}/dagster"
    finally:
        subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(real, ignore_errors=True)


class RedisServer:
    """A Redis server on 127.0.0.1:``port`` with its files in ``folder``. ``persist`` keeps its data in an
    append-only file that is synced at every write, as a broker whose queue must outlive a restart does."""

    def __init__(self, folder: Path, port: int, *, persist: bool = False) -> None:
        self.folder, self.port, self.persist = folder, port, persist
        self.url = f"redis://127.0.0.1:{port}/0"
        self.binary = shutil.which("redis-server") or _unavailable("Redis's redis-server is not installed")
        folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        with open(self.folder / "server.log", "ab") as log:
            self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                          *persistence, "--dir", str(self.folder)], stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # as a crash would: what is not in the append-only file is gone
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(folder: Path, port: int, *, persist: bool = False) -> Iterator[RedisServer]:
    """A started RedisServer; killed at the end."""
    server = RedisServer(folder, port, persist=persist).start()
    try:
        yield server
    finally:
        server.stop()


def restart_postgres(folder: Path) -> None:
    """An immediate stop (as a crash) and a start of the server postgres_server(folder, ...) runs, same options."""
    pg_ctl = _pg_bin("pg_ctl")
    folder = folder.resolve()  # the server's own folder (see postgres_server)
    # -l again: without it the server would write to (and hold open) this call's captured stdout.
    subprocess.run(_as_server_user([pg_ctl, "-D", str(folder / "data"), "-m", "immediate", "-l",
                                    str(folder / "server.log"), "-w", "restart"]), check=True, capture_output=True)


def stop_postgres(folder: Path) -> None:
    """An immediate stop, as a crash would, of the server postgres_server(folder, ...) runs: an outage begins."""
    folder = folder.resolve()
    subprocess.run(_as_server_user([_pg_bin("pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "-w", "stop"]),
                   check=True, capture_output=True)


def start_postgres(folder: Path) -> None:
    """Start again, with the same options, the server stop_postgres(folder) stopped: the outage ends."""
    folder = folder.resolve()
    subprocess.run(_as_server_user([_pg_bin("pg_ctl"), "-D", str(folder / "data"), "-o",
                                    (folder / OPTIONS_FILE).read_text(), "-l", str(folder / "server.log"), "-w",
                                    "start"]), check=True, capture_output=True)
