"""Stopping the servers `ui` and `--auto-resume` start: every process of their groups is gone when it returns."""

import socket
import subprocess
import sys
import time

import psutil
import pytest

from gguf_assets.cli.services import PortTaken, ServiceOutput, check_ports_free, stop_services

# A server whose helper (as Dagster's code servers are to its webserver and daemon) outlives it: the leader exits at
# once on SIGTERM, its child in the same process group takes ``linger`` s, or ignores SIGTERM when ``linger`` < 0.
SERVER = """
import signal, subprocess, sys, time
linger = float(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", f'''
import signal, sys, time
linger = {linger}
if linger < 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(linger), sys.exit(0)))
print("ready", flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start(linger: float) -> tuple[subprocess.Popen, int]:
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(linger)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return server, int(server.stdout.readline())


def test_stop_returns_after_the_group_s_lingering_members_not_only_its_leader():
    server, helper = _start(linger=1.5)
    started = time.monotonic()
    stop_services([server], grace_s=30)
    took = time.monotonic() - started
    assert server.poll() is not None and _gone(helper), psutil.Process(helper).status()
    assert took >= 1.0, took  # it waited for the helper's own shutdown, which ends it cleanly


def test_a_member_that_ignores_sigterm_is_killed_after_the_grace():
    server, helper = _start(linger=-1)
    started = time.monotonic()
    stop_services([server], grace_s=1.0)
    assert _gone(helper) and server.poll() is not None
    assert time.monotonic() - started < 20  # the grace, then SIGKILL: not a wait for the helper's 600 s


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free_and_a_listening_one_is_taken():
    """A `ui` stopped and started again at once: the connections its servers closed wait in TIME_WAIT on their ports
    for a minute, and the servers bind over them (SO_REUSEADDR); the check must not refuse what they would take."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    with pytest.raises(PortTaken, match=f"127.0.0.1:{port} is already in use.*--port N"):
        check_ports_free("127.0.0.1", {"--port": port})
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first, as a stopped server does: its side of the connection is in TIME_WAIT
    client.close()
    server.close()

    def states() -> set[str]:
        return {c.status for c in psutil.net_connections("tcp4") if c.laddr and c.laddr.port == port}

    deadline = time.monotonic() + 10  # the client's FIN reaches the closed side at once, but a loaded machine lags
    while psutil.CONN_TIME_WAIT not in states() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert psutil.CONN_TIME_WAIT in states(), states()
    check_ports_free("127.0.0.1", {"--port": port})


def test_service_output_shows_whole_lines_until_closed_and_only_keeps_the_rest(tmp_path):
    """The servers' output (through their log) reaches the console line by line while they serve; from close on, which
    comes before they are told to stop, what they write is only in the log: a code server stopped while it imports
    the definitions prints a traceback that whoever stopped it need not read."""
    import io

    console = io.StringIO()
    output = ServiceOutput(tmp_path / "services.log", console=console)
    with open(output.file, "ab") as server:  # as start_services opens it for each server
        server.write(b"serving on :3000\nhalf a li")
        server.flush()
        deadline = time.monotonic() + 30
        while "serving" not in console.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert console.getvalue() == "serving on :3000\n"  # not the half line yet
        server.write(b"ne\nand its last, without a newline")
        server.flush()
        output.close()
        server.write(b"Traceback (most recent call last):\n")
        server.flush()
    time.sleep(3 * ServiceOutput.POLL_S)
    assert console.getvalue() == "serving on :3000\nhalf a line\nand its last, without a newline\n"
    assert output.file.read_bytes().endswith(b"Traceback (most recent call last):\n")
    output.close()  # a second close (supervise closes before it names a server that ended, then stops the rest)


def test_a_stop_noted_before_the_pipeline_starts_starts_no_pipeline(monkeypatch):
    """`auto-resume` notes stops (services.StopSignals) before it hands the pipeline to its own process group: one
    noted already is not lost in between, and no pipeline starts (its process would run on regardless)."""
    import signal as signals

    from gguf_assets.cli import processes

    class Noted:
        signal = signals.SIGTERM

        def note(self, signum, _frame=None):
            pass

    def no_child(*args, **kwargs):
        raise AssertionError("a pipeline was started after the stop")

    monkeypatch.setattr(processes.subprocess, "Popen", no_child)
    before = {sig: signals.getsignal(sig) for sig in (signals.SIGINT, signals.SIGTERM)}
    assert processes.run_in_own_process_group(["run", "project"], stop=Noted()) == 128 + signals.SIGTERM
    assert {sig: signals.getsignal(sig) for sig in before} == before  # its forwarding handlers are gone again
