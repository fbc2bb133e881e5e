"""Warm `gguf-trainer` processes for the tests: `run`, and the commands that read a project (#34: the suite's CPU
goes mostly to processes loading the same modules again: torch, transformers' model code and Dagster, 3 to 6 CPU
seconds a run on this machine).

A test that runs the pipeline many times (killed at a fault point, then resumed, and so on) calls
``trainer_run`` or ``trainer_popen`` instead of subprocess.run or Popen of ``[*CLI, "run", ...]`` (and of the
commands that read or describe a project: `status`, `verify`, `runs`, `estimate`, `env`). Each test process keeps
one loader process, which has loaded what a run loads (what the studio's spare run loads ahead,
studio/spare_run.py, and the model code), and forks a run per request. The run is a real process of its own
process group, as the child of `gguf-trainer run` is, and runs the same code from the same entry (``cli.main`` with
GGUF_ASSETS_RUN_CHILD set); signals, kill -9 and the exit status behave as for that child. What it leaves out is the
thin parent that `gguf-trainer run` puts in front of the work (it prints "starting", forwards Ctrl-C and
SIGTERM, and dies with its child): the tests of that parent, of Ctrl-C, of the console and of what a cold start
prints keep starting `gguf-trainer run` cold.
A fork ends as Python ends (threads joined, atexit functions, stdio flushed) but skips the interpreter's teardown
of what the loader loaded (``_end``: about 0.3 CPU s a fork), whether it ran a command or a script.

The loader forks a Python script too (``script_run``, ``script_popen``: the benchmarks' tests): the fork runs it as
``python SCRIPT ARGS`` would (``runpy.run_path`` under the name "__main__", sys.argv, the script's folder first on
sys.path in place of this file's), with the stdio, exit status and signals above. What the script sets up itself
(logging's configuration, torch's threads, signal handlers) it sets up in the fork as it would cold. What the
loader's imports set up stays, where the script would not have imported that module: a warnings filter (Dagster's
BetaWarning, ignored by gguf_assets.defs) or a library's logger, so a warning that a cold start prints on stderr may
be missing. Its stdout and status are a cold start's (estimate_large.py, estimate_llada.py --quick, gpu_check.py
--tiny and bench_quality.py --study --quick printed the same bytes both ways, but for their timings).

A request whose environment differs from the loader's in a variable that a loaded library reads when it is
imported (HF_HOME, OMP_NUM_THREADS, ...) is started cold instead, as is every request when the loader cannot be
started: a warm run never runs with settings other than those of a cold one.

    python gguf_assets_tests/warm_runs.py SOCKET     # the loader (WarmRuns starts it)
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from gguf_assets.cli.processes import _die_with_parent
from gguf_assets.studio import spare_run  # light: it loads the rest when it runs

CLI = [sys.executable, "-m", "gguf_assets.cli"]
RUN_CHILD_ENV = spare_run.RUN_CHILD_ENV
# Read by torch, transformers, huggingface_hub, tokenizers or Python itself when they load (or when the
# process starts): a request that differs from the loader in one of them runs cold.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
                        "OPENBLAS", "CUDA", "TOKENIZERS", "PYTHON", "TQDM", "XDG_", "LD_", "GGUF_ASSETS_TEST")
# What a run loads: what the studio's spare run loads ahead (studio/spare_run.py), the entry point, the
# definitions' asset modules and the model code of the demo's families. Not gguf_assets.definitions, which reads the
# project at import.
PRELOAD = (*spare_run.PRELOAD, "gguf_assets.cli.commands", "gguf_assets.defs.materials", "gguf_assets.defs.corpus",
           "gguf_assets.defs.precompute", "gguf_assets.defs.training", "gguf_assets.defs.output",
           "gguf_assets.defs.sensors", "gguf_assets.defs.jobs", "gguf_assets.lib.precompute.shards",
           "gguf_assets.lib.output.gguf_eval", "accelerate", "transformers.modeling_utils",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe")
_REQUEST_BYTES = 1 << 20
FORK_LOG_ENV = "SUITE_CPU_FORK_LOG"  # scripts/suite_cpu.py's: where the forks' tests are noted (_note_fork)


# Set by torch itself in a process that loaded its compiler (some tests do), not read by what the loader loads.
SET_BY_LIBRARIES = ("TORCHINDUCTOR_CACHE_DIR",)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in SET_BY_LIBRARIES}


# --- the loader process -------------------------------------------------------------------------------------------

def _become_run(request: dict, fds: list[int]) -> None:
    """In the forked child: the stdio, folder, environment, process group and signals of a fresh run process."""
    if request["new_session"]:
        os.setsid()
    else:
        os.setpgid(0, 0)  # as `gguf-trainer run` starts its child (process_group=0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as Python sets up its stdout at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def serve(path: str) -> list[str]:
    """Load, then fork a run per request on the socket at ``path``; returns only in a forked run, its argv."""
    _die_with_parent()  # ends with the test process, however that ends (cleared in each forked run, as in any fork)
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the loaded objects stay out of the runs' collections, so their pages stay shared
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, wake_read], [], [])
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            while runs:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = runs.pop(pid, None)
                if conn is not None:
                    _send(conn, {"status": status})
                    conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _REQUEST_BYTES, 3)
            if not message:  # the tests' side went away
                conn.close()
                continue
            request = json.loads(message)
            set_up_read, set_up_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for sock in (listener, conn, *runs.values()):
                    sock.close()
                for fd in (wake_read, wake_write, set_up_read):
                    os.close(fd)
                _become_run(request, fds)
                os.close(set_up_write)  # its process group exists now, as Popen's child's does when Popen returns
                return request["argv"]
            for fd in (*fds, set_up_write):
                os.close(fd)
            os.read(set_up_read, 1)  # end of file once the run has set itself up (or died trying)
            os.close(set_up_read)
            _send(conn, {"pid": pid})
            runs[pid] = conn


def run_script(argv: list[str]) -> None:
    """In a forked run: ``python SCRIPT ARGS`` (``argv``), as a cold interpreter runs it: sys.argv as given, the
    script's folder first on sys.path, ``__file__`` absolute. Its SystemExit, or an exception it does not catch,
    ends this process as it ends a cold one; an end with a status (0 to 255) skips the interpreter's teardown
    (``_end``)."""
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # this file's folder, where the loader started

    def as_main() -> None:  # what the script's module holds at its end is no status
        runpy.run_path(script, run_name="__main__")

    _run_then_end(as_main)


def run_command(argv: list[str]) -> None:
    """In a forked run: `gguf-trainer ARGS` (``argv``), from the same entry as the command's own process
    (``cli.main``), ended as ``run_script`` ends a script."""
    sys.argv = ["gguf-trainer", *argv]
    from gguf_assets import cli

    _run_then_end(lambda: cli.main(argv))


def _run_then_end(run) -> None:
    """``run()``, then this process ends with its status (what it returns, or its SystemExit's code) as a cold one
    does; a status of 0 to 255 skips the interpreter's teardown (``_end``), anything else (a message, an exception
    ``run`` does not catch) takes Python's own way."""
    try:
        code = run()
    except SystemExit as stop:
        code = stop.code
    if not (code is None or isinstance(code, int) and 0 <= code <= 255):
        raise SystemExit(code)  # Python's own way: a message printed, status 1
    _end(code or 0)


def _end(status: int) -> None:
    """Exit as Python exits (waiting for the threads that are not daemons, then the atexit functions, then stdout
    and stderr flushed; 120 when stdout cannot be), without its teardown: tearing down the modules the loader
    loaded writes to nearly every page the fork shares with the loader, 0.33 CPU s for a script that prints one
    line (0.02 s cold). Lost with it: what objects' __del__ would do at exit, such as flushing a file the script
    left open."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except Exception:  # as Python's exit: the status says so
        status = 120
    try:
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(status)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the test that asked has ended
        pass


# --- the tests' side ----------------------------------------------------------------------------------------------

class WarmRuns:
    """The loader process of this test process: started at the first request, in the environment this process had
    when the tests began (``env``), and ended with the process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._folder = ""
        self.socket_path = ""
        self.broken = False

    def start(self) -> bool:
        with self._lock:
            if self._process is None and not self.broken:
                self._folder = tempfile.mkdtemp(prefix="warm-runs-")
                self.socket_path = os.path.join(self._folder, "loader")
                self._process = subprocess.Popen([sys.executable, __file__, self.socket_path], env=self.env,
                                                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
                ready = select.select([self._process.stdout], [], [], 300)[0]
                if not ready or self._process.stdout.readline() != b"ready\n":
                    self._process.kill()
                    self._process.wait()
                    self.broken = True  # every run starts cold from here on
                atexit.register(self.close)
            return not self.broken

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)

    def suits(self, env: dict[str, str]) -> bool:
        return import_time_env(env) == import_time_env(self.env) and self.start()


class WarmRun(subprocess.Popen):
    """A run forked by the loader: subprocess.Popen's interface (pipes, communicate, wait, poll, send_signal,
    kill), with the exit status reported by the loader, whose child it is."""

    def __init__(self, loader: WarmRuns, args: list[str], **kwargs) -> None:
        self._loader, self._socket = loader, None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        assert preexec_fn is None and not pass_fds and process_group in (None, -1), "not for a warm run"
        request = {"argv": list(args), "cwd": os.fspath(cwd or os.getcwd()), "env": dict(env),
                   "new_session": bool(start_new_session)}
        # -1: the child inherits this process's stream, as Popen's own children do
        fds = [fd if fd != -1 else own for fd, own in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._socket.connect(self._loader.socket_path)
            socket.send_fds(self._socket, [json.dumps(request).encode()], fds)
            self.pid = json.loads(self._socket.recv(4096))["pid"]
            _note_fork(self.pid)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._child_created = True

    def _try_wait(self, wait_flags):
        """The loader's word on the run's end, as os.waitpid would give it: (pid, status), or (0, 0) not yet."""
        if wait_flags & os.WNOHANG and not select.select([self._socket], [], [], 0)[0]:
            return 0, 0
        answer = self._socket.recv(4096)
        if not answer:  # the loader died: the run cannot be waited for any more
            raise ChildProcessError(f"the warm-run loader ended before run {self.pid}")
        self._socket.close()
        return self.pid, json.loads(answer)["status"]

    def _internal_poll(self, _deadstate=None, **_ignored):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except (OSError, ValueError):
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _note_fork(pid: int) -> None:
    """For scripts/suite_cpu.py, when it runs the tests: the fork's test, which its /proc entry cannot name (its
    environment there is the loader's)."""
    log = os.environ.get(FORK_LOG_ENV)
    if not log:
        return
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as proc_stat:
            stat = proc_stat.read()
    except OSError:  # ended already
        return
    started = stat[stat.rindex(")") + 2:].split()[19]
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    with open(log, "a", encoding="utf-8") as out:  # one short line: appended whole beside other writers
        out.write(f"{pid}\t{started}\t{test}\n")


# Before any test changes the environment: the loader's, and the one a request must match in IMPORT_TIME_PREFIXES.
_LOADER = WarmRuns(dict(os.environ))


# The commands a loader forks: `run` (as the pipeline's own process) and the ones that read, check or describe a
# project (`env` prints its exports, after creating its Dagster storage as `run` does), or take a snapshot of it.
WARM_COMMANDS = ("run", "status", "verify", "runs", "estimate", "env", "snapshot")


def trainer_popen(args: list[str], *, env: dict[str, str], warm: bool = True, **kwargs) -> subprocess.Popen:
    """subprocess.Popen of `gguf-trainer ARGS` (``args`` without the program): a warm process when it can be one
    (one of WARM_COMMANDS, ``warm``, and the module docstring's rule), else the command itself, cold."""
    if warm and args[0] in WARM_COMMANDS and _LOADER.suits(env):
        return WarmRun(_LOADER, args, env={**env, RUN_CHILD_ENV: "1"} if args[0] == "run" else env, **kwargs)
    return subprocess.Popen([*CLI, *args], env=env, **kwargs)


def script_popen(script: str | os.PathLike, args: list[str], *, env: dict[str, str],
                 **kwargs) -> subprocess.Popen:
    """subprocess.Popen of ``python SCRIPT ARGS`` (``script`` a .py file): a warm process when the environment suits
    the loader (the module docstring's rule), else the script itself, cold."""
    argv = [os.fspath(script), *args]
    if not argv[0].endswith(".py"):
        raise ValueError(f"not a Python script: {argv[0]}")
    if _LOADER.suits(env):
        return WarmRun(_LOADER, argv, env=env, **kwargs)
    return subprocess.Popen([sys.executable, *argv], env=env, **kwargs)


def trainer_run(args: list[str], *, env: dict[str, str], timeout: float | None = None, check: bool = False,
                capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of ``trainer_popen``."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return _finished(trainer_popen(args, env=env, **kwargs), timeout=timeout, check=check)


def script_run(script: str | os.PathLike, args: list[str], *, env: dict[str, str], timeout: float | None = None,
               check: bool = False, capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of ``script_popen``."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return _finished(script_popen(script, args, env=env, **kwargs), timeout=timeout, check=check)


def _finished(process: subprocess.Popen, *, timeout: float | None, check: bool) -> subprocess.CompletedProcess:
    """What subprocess.run returns for ``process``, run to its end (killed after ``timeout``, and raised)."""
    with process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _argv = serve(sys.argv[1])
    if _argv[0].endswith(".py"):  # script_popen's: no gguf-trainer command is named so
        run_script(_argv)
    else:
        run_command(_argv)
