"""The long-running servers `gguf-trainer ui` and `auto-resume` start (the studio, Dagster's webserver behind the
studio's guard, TensorBoard, dagster-daemon): their commands, starting them in sessions of their own, watching them,
and stopping them all on Ctrl-C or when one ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

import psutil

from gguf_assets import DEFINITIONS_MODULE
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import venv_tool
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.telemetry.curves_log import TENSORBOARD_DIR

SERVICES_LOCK = "services.lock"  # in <project>/.dagster: held while the project's studio, Dagster UI or daemon run
SERVICES_LOG = "services.log"  # in <project>/.dagster: what they wrote, since the latest `ui` or `auto-resume` started


def studio_command(paths: ProjectPaths, host: str, port: int, *, dagster_url: str,
                   tensorboard_url: str, allow_hosts: list[str] = (), spare_run: bool = True) -> list[str]:
    return [sys.executable, "-m", "gguf_assets.studio", str(paths.root), "--host", host, "--port", str(port),
            "--dagster-url", dagster_url, "--tensorboard-url", tensorboard_url, *_allow_host_args(allow_hosts),
            *([] if spare_run else ["--no-spare-run"])]


def tensorboard_command(paths: ProjectPaths, host: str, port: int, allow_hosts: list[str] = ()) -> list[str]:
    """TensorBoard behind the studio's guard (the Host allow-list)."""
    return [sys.executable, "-m", "gguf_assets.studio.tensorboard", "--logdir", str(paths.root / TENSORBOARD_DIR),
            "--host", host, "--port", str(port), *_allow_host_args(allow_hosts)]


def start_services(commands: list[list[str]], *, log_file: Path | None = None,
                   keep_fds: tuple[int, ...] = ()) -> list[subprocess.Popen]:
    """Start long-running processes, each in its own session so a stop reaches its children.

    With ``log_file`` their output goes there instead of the console. ``keep_fds``: open files they inherit (the
    services lock, held for as long as any of them runs).
    """
    out = open(log_file, "ab") if log_file else None  # noqa: SIM115  (the children keep it open)
    started: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            started.append(subprocess.Popen(cmd, env=os.environ.copy(), start_new_session=True, stdout=out,
                                            stderr=subprocess.STDOUT if out else None, pass_fds=keep_fds))
        return started
    except BaseException:  # one that cannot start: none of this call's keeps running unseen
        stop_services(started)
        raise
    finally:
        if out:
            out.close()


class ServiceOutput:
    """What the servers write, stdout and stderr, through a file (``SERVICES_LOG``): shown on this console (stderr)
    a whole line at a time while they serve, and only kept in the file from the moment they are told to stop.

    Stopped while they start, each says so its own way: a code server still importing the definitions prints
    DagsterExecutionInterruptedError's traceback, the webserver click's "Aborted!", the webserver and the daemon a
    warning with a stack trace about their code server. Whoever stopped them knows already, so the console of `ui`
    and `auto-resume` stays clean at every moment; the file has it all. A file, not a pipe: servers left running by a
    `ui` killed with -9 write on, where a pipe without its reader would fail their writes.
    """

    POLL_S = 0.1

    def __init__(self, file: Path, console: TextIO | None = None) -> None:
        self.file = file
        file.write_bytes(b"")  # these servers' only: one set per project at a time (the services lock is held)
        self._console = console if console is not None else sys.stderr
        self._reader = open(file, "rb")  # noqa: SIM115  (read until close)
        self._partial = b""
        self._closed = False
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="service-output", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._over.wait(self.POLL_S):
            self._show()

    def _show(self, *, last: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            data = self._partial + self._reader.read()
            lines, newline, self._partial = data.rpartition(b"\n")
            text = (lines + newline + (self._partial + b"\n" if last and self._partial else b"")).decode(
                errors="replace")
            if text:
                try:
                    self._console.write(text)
                    self._console.flush()
                except (OSError, ValueError):  # the console is gone (a closed pipe): the file still has it
                    last = True
            if last:
                self._closed = True
                self._reader.close()

    def close(self) -> None:
        """Show what the servers wrote up to now, then nothing more: call it before they are told to stop."""
        self._over.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._show(last=True)


class StopSignals:
    """Ctrl-C and SIGTERM noted instead of raised, from entering on: a stop that comes while services are being
    started cannot leave one running that the starter never heard of."""

    def __enter__(self) -> "StopSignals":
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self.note) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def note(self, signum, _frame=None) -> None:
        """The handler; also called by whoever handles a signal in its place for a while (a pipeline's process
        group forwards each one to the pipeline, and notes it here)."""
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(procs: list[subprocess.Popen], *, grace_s: float = 10.0, stop: StopSignals | None = None,
              output: ServiceOutput | None = None) -> int:
    """Wait until one process exits or we get Ctrl-C/SIGTERM; then stop them all promptly.

    Each child gets SIGTERM, then SIGKILL after ``grace_s`` (dagster dev was seen ignoring
    SIGTERM for over a minute, so the webserver and daemon are run and stopped directly).
    ``stop``: the caller's, when it noted signals already while it started ``procs``. ``output``: where they write;
    what they wrote before the stop is shown, what they write while being stopped only kept.
    """
    with contextlib.ExitStack() as stack:
        stop = stop or stack.enter_context(StopSignals())
        try:
            while stop.signal is None and all(p.poll() is None for p in procs):
                time.sleep(0.2)
            ended = next((p for p in procs if p.returncode is not None), None)
            if stop.signal is None and ended is not None:
                if output is not None:
                    output.close()  # the ended one's last words first
                print(f"{_service_name(ended.args)} stopped ({_how_it_ended(ended.returncode)}); stopping the rest",
                      flush=True)
        finally:
            stop_all(procs, output, grace_s=grace_s)
    if stop.signal is not None:
        return 0
    # A service stopped by a signal (systemd's SIGTERM, a kill) was stopped on purpose; a crash is an error.
    return max((p.returncode or 0) if (p.returncode or 0) > 0 else 0 for p in procs)


def _service_name(command: list[str]) -> str:
    """`dagster-daemon`, or the module of a `python -m gguf_assets.studio.dagster_ui` service."""
    return command[2] if len(command) > 2 and command[1] == "-m" else Path(command[0]).name


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"by {signal.Signals(-returncode).name}"
    return "exit code 0" if returncode == 0 else f"exit code {returncode}"


def stop_all(procs: list[subprocess.Popen], output: ServiceOutput | None, *, grace_s: float = 10.0) -> None:
    """:func:`stop_services`, once what they wrote so far is on the console and the rest goes to their log only."""
    if output is not None:
        output.close()
    stop_services(procs, grace_s=grace_s)


def stop_services(procs: list[subprocess.Popen], *, grace_s: float = 10.0) -> None:
    """SIGTERM to each server's process group; returns once every member is gone (SIGKILL after ``grace_s``), not
    only the leader: the code servers Dagster's webserver and daemon start shut down after them, and a `ui` started
    right after this one must not find their processes (or ports) still there."""
    for p in procs:
        if p.poll() is None:
            if before_stop := getattr(p, "before_stop", None):  # a server that a signal does not stop (CodeServer)
                before_stop()
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    groups = {p.pid for p in procs}
    _wait_for_no_members(groups, deadline)
    for member in _group_members(groups):
        with contextlib.suppress(psutil.Error):
            member.kill()
    _wait_for_no_members(groups, time.monotonic() + 5)  # a SIGKILL lands at once, but not synchronously


def _wait_for_no_members(groups: set[int], deadline: float) -> None:
    while _group_members(groups) and time.monotonic() < deadline:
        time.sleep(0.1)


def _group_members(groups: set[int]) -> list[psutil.Process]:
    """The live processes (not zombies, which hold nothing and wait for their parent) in these process groups."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


class PortTaken(UserError):
    """A port the UI needs is already in use."""


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Refuse at once when a port is taken: the server would exit after printing its address, and the user
    would browse whatever holds the port (another project's UI)."""
    import socket

    for option, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # As the servers bind (uvicorn, werkzeug): the connections a just-stopped `ui` left in TIME_WAIT do not
            # count, a server listening there does. Without it a `ui` started again within a minute was refused.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise PortTaken(f"{host}:{port} is already in use ({exc.strerror}): another `gguf-trainer ui` "
                                f"or Dagster may be serving there. Choose a free port with {option} N, or stop "
                                "the other one.") from None


# Dagster's servers log every sensor tick and code-server start at INFO, several lines a minute, into the console
# of `ui` and `auto-resume` (or a boot service's journal), where they buried what the user must read. Warnings and
# errors still show; each tick, with why it skipped or what it launched, is in the UI (Automation, the sensor's
# ticks), and each run's events in its page.
DAGSTER_SERVER_LOG_LEVEL = "warning"


class CodeServer:
    """The one Dagster code server of a project's webserver and daemon (`dagster code-server start`), on a Unix
    socket in a private temporary folder, with the workspace file that points both at it.

    Given the definitions module (`-m`), dagster-daemon drops its code server every 60 s
    (RELOAD_WORKSPACE_INTERVAL) and starts a new one, which imports the definitions again; the dropped one shuts
    down 20 s later, printing "No heartbeat received in 20 seconds, shutting down" (dagster-io/dagster#14649): a
    warning a minute in the `ui` terminal, and an import of the pipeline a minute on an idle machine. Pointed at a
    server of its own (a `grpc_server` location), the daemon's reload only asks that server again, and the
    webserver shares it: one import of the definitions for the whole `ui`. The socket, not a port: only this user
    can reach it (the folder is 0700), and it names no place in the project folder. Runs that the daemon or the
    UI launch are this server's children, as they were the webserver's and the daemon's own servers' (a stop of
    `ui` stops them, CANCELED and resumable).
    """

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="gguf-assets-code-")
        folder = Path(self._folder.name)
        self.socket = folder / "code.sock"
        self.workspace = folder / "workspace.yaml"
        # The location keeps the name `-m` gives it (orchestration/instance.py CODE_LOCATION): runs and schedules
        # recorded before, and `gguf-trainer run`'s runs, name that location.
        atomic.write_text(self.workspace, json.dumps({"load_from": [{"grpc_server": {
            "socket": str(self.socket), "location_name": DEFINITIONS_MODULE}}]}))  # YAML reads JSON

    def command(self) -> list[str]:
        return [venv_tool("dagster"), "code-server", "start", "-m", DEFINITIONS_MODULE, "--socket", str(self.socket),
                "--location-name", DEFINITIONS_MODULE, "--log-level", DAGSTER_SERVER_LOG_LEVEL]

    def wait_until_serving(self, process: subprocess.Popen, stop: StopSignals, *, timeout_s: float = 600) -> bool:
        """Wait until it answers gRPC's health check (it binds its socket once the definitions are loaded): the
        webserver and the daemon load their workspace once at their start. False on a stop; a server that exits
        or never answers is a UserError naming its log."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        while stop.signal is None:
            if process.poll() is not None:
                raise UserError(f"the Dagster code server stopped ({_how_it_ended(process.returncode)}) while "
                                "loading the pipeline's definitions; its output is in .dagster/"
                                f"{SERVICES_LOG}")
            if self.socket.exists():
                with grpc.insecure_channel(f"unix:{self.socket}") as channel:
                    with contextlib.suppress(grpc.RpcError):
                        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                          timeout=5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return True
            if time.monotonic() > deadline:
                raise UserError(f"the Dagster code server did not answer within {timeout_s:.0f} s; its output is "
                                f"in .dagster/{SERVICES_LOG}")
            time.sleep(0.2)
        return False

    def start(self, *, log_file: Path, keep_fds: tuple[int, ...]) -> subprocess.Popen:
        """Start it (start_services); ``stop_services`` asks it to stop by its own call before the signal."""
        (process,) = start_services([self.command()], log_file=log_file, keep_fds=keep_fds)
        process.before_stop = self.ask_to_stop
        return process

    def ask_to_stop(self) -> None:
        """Dagster's ShutdownServer call (pipeline/private_api.py says why a signal is not enough); nothing where it
        is not serving (yet, or any more)."""
        if not self.socket.exists():
            return
        from gguf_assets.pipeline.private_api import DagsterGrpcClient

        with contextlib.suppress(Exception):  # it may be stopping already: the signal and the wait still follow
            DagsterGrpcClient(socket=str(self.socket)).shutdown_server(timeout=5)

    def close(self) -> None:
        """Once it has stopped: its folder (socket and workspace file) goes."""
        self._folder.cleanup()


def webserver_command(host: str, port: int, allow_hosts: list[str] = (), *, workspace: Path) -> list[str]:
    """Dagster's own webserver behind the studio's guard (the Host allow-list, the Origin check, the body cap), on
    the project's one code server (``workspace``: CodeServer's)."""
    return [sys.executable, "-m", "gguf_assets.studio.dagster_ui", "--host", host, "--port", str(port),
            *_allow_host_args(allow_hosts), "--workspace", str(workspace), "--dagster-log-level",
            DAGSTER_SERVER_LOG_LEVEL]


def _allow_host_args(allow_hosts: list[str]) -> list[str]:
    return [arg for name in allow_hosts for arg in ("--allow-host", name)]


def daemon_command(*, workspace: Path) -> list[str]:
    """dagster-daemon on the project's one code server (``workspace``: CodeServer's)."""
    return [venv_tool("dagster-daemon"), "run", "-w", str(workspace), "--log-level", DAGSTER_SERVER_LOG_LEVEL]
