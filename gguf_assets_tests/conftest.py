"""Shared fixtures: the tiny demo materials are built once per session and copied per test."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from filelock import FileLock

# The per-user hub store (lib/materials/hub/store.py) of this test process: never the user's own ~/.cache. Set before
# warm_runs starts its loader, so every run process has it; loopback_hub gives each test a store of its own. Removed
# when this process ends (not by the forked run processes, which inherit the handler).
if "GGUF_ASSETS_STORE" not in os.environ:
    import atexit

    _STORE, _OWNER = tempfile.mkdtemp(prefix="gguf-assets-test-store-"), os.getpid()
    os.environ["GGUF_ASSETS_STORE"] = _STORE
    atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(_STORE, ignore_errors=True))

from warm_runs import CLI, trainer_run  # noqa: E402

from gguf_assets.lib.demo.demo import QUARTER_SIZES, build_demo_materials, demo_settings
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, replace, write_project_file


def built_once(tmp_path_factory, worker_id: str, name: str, build) -> tuple[Path, str]:
    """``build(folder)`` once for the whole suite: under pytest-xdist the workers share one folder, made by the
    first that asks while the others wait (xdist's documented file-lock pattern). Returns the folder and the text
    ``build`` returned. The folder is never changed afterwards: tests work on copies."""
    if worker_id == "master":  # one process: nothing to share
        folder = tmp_path_factory.mktemp(name)
        return folder, build(folder)
    folder = tmp_path_factory.getbasetemp().parent / name
    marker = folder.with_name(name + ".built")
    with FileLock(str(folder) + ".lock"):
        if not marker.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build that died half way
            folder.mkdir()
            marker.write_text(build(folder))
    return folder, marker.read_text()


@pytest.fixture(scope="session")
def demo_materials_root(tmp_path_factory, worker_id) -> Path:
    def build(root: Path) -> str:
        build_demo_materials(root, seed=0)
        return ""

    return built_once(tmp_path_factory, worker_id, "demo-materials", build)[0]


def new_demo_project(root: Path, demo_materials: Path, *, steps: int = 120, mock_teacher: bool = False,
                     **changes) -> ProjectPaths:
    """A demo project folder at ``root``: a copy of the demo materials and its project.yaml, at the demo's
    QUARTER_SIZES unless ``changes`` say otherwise (per key)."""
    shutil.copytree(demo_materials, root / "materials" / "demo")
    sized = replace(demo_settings(steps=steps, mock_teacher=mock_teacher), **QUARTER_SIZES)
    settings: Settings = replace(sized, **changes)  # per key: a change to corpus.seed keeps the sizes above
    write_project_file(root, settings)
    return ProjectPaths.of(root)


@pytest.fixture
def make_project(tmp_path, demo_materials_root, monkeypatch):
    """make_project(settings_changes) → ProjectPaths of a fresh demo project with its own DAGSTER_HOME."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # restored after the test; runner re-points it
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(tmp_path))
    counter = {"n": 0}

    def make(steps: int = 120, mock_teacher: bool = False, **changes) -> ProjectPaths:
        counter["n"] += 1
        return new_demo_project(tmp_path / f"project{counter['n']}", demo_materials_root, steps=steps,
                                mock_teacher=mock_teacher, **changes)

    return make


@pytest.fixture
def loopback_hub(tmp_path, demo_materials_root, monkeypatch):
    """A loopback hub (hub_server.LoopbackHub) serving the demo teacher, student and prompts.

    HF_ENDPOINT points at it, HF_HOME is a temp folder holding a stored token that must never be
    sent (implicit tokens are left enabled here, so the code under test must be what stops it),
    Xet and telemetry are off and HF_TOKEN is unset. Repos: demo/teacher, demo/student, demo/sigvq (models)
    and demo/prompts (dataset).
    """
    from hub_server import STORED_HF_TOKEN, LoopbackHub

    hf_home = tmp_path / "hf-home"
    hf_home.mkdir()
    (hf_home / "token").write_text(STORED_HF_TOKEN)
    # A new machine per test: its own per-user hub store, empty (a test of the store shares one on purpose).
    monkeypatch.setenv("GGUF_ASSETS_STORE", str(tmp_path / "user-hub-store"))
    for name, value in {"HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LoopbackHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.add_repo("demo/teacher", demo_materials_root / "teacher")
        hub.add_repo("demo/student", demo_materials_root / "student")
        hub.add_repo("demo/sigvq", demo_materials_root / "sigvq")
        hub.add_repo("demo/prompts", demo_materials_root / "dataset", kind="dataset")
        yield hub


# A short mock-teacher pipeline for the kill and resume tests: 5 shards, 40 small steps, 8
# checkpoints. The small batch keeps the training part a few seconds; kills still land mid-way.
FAULT_SETTINGS = dict(steps=40, mock_teacher=True,
                      training={"checkpoint_every": 5, "validate_every": 20, "log_every": 10, "batch_size": 8})


def pipeline_outputs(root: Path) -> dict[str, bytes]:
    """Everything that must not depend on faults: shard halves, final weights, the GGUFs."""
    files = sorted(root.glob("shards/*/*/*.safetensors")) + sorted(root.glob("checkpoints/*/final/adapter.safetensors"))
    files += sorted(root.glob("output/*.gguf"))
    return {str(f.relative_to(root)): f.read_bytes() for f in files}


def cli_env(**extra: str) -> dict:
    """The environment for a gguf-trainer subprocess: this one without the test's Dagster
    home, project or fault switch (the CLI sets its own), plus ``extra``."""
    dropped = ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT", "GGUF_ASSETS_FAULT")
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


def assert_clean_console(out: str) -> None:
    """No stack trace, no library load report or progress bar, no colour codes, no doubled line."""
    assert "Traceback" not in out and "LOAD REPORT" not in out and "Loading weights" not in out, out
    assert "\x1b[" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    doubled = [a for a, b in zip(lines, lines[1:]) if a.split(" ", 1)[-1] == b.split(" ", 1)[-1]]
    assert not doubled, doubled


def assert_fits_80_columns(text: str) -> None:
    """Terminal output in 80 columns: every line, but one that holds a command to paste (the tool's console script and
    its words, lib/core/commands.py shell_line), which stays whole however long, alone or after a short label, and
    one word alone that no line holds (a path deep in the temp folder)."""
    import re

    from gguf_assets.lib.core.commands import venv_tool

    command = rf"\s*(\S[^`]{{0,38}}\s)?`?{re.escape(venv_tool('gguf-trainer'))} [^`]*`?[.,;:)]?"
    wide = [line for line in text.splitlines() if len(line) > 80 and not re.fullmatch(command, line)
            and len(line.split()) > 1]
    assert not wide, "over 80 columns:\n" + "\n".join(wide)


def unwrapped(text: str) -> list[str]:
    """The logical lines of console output that lib/core/console.py wrapped: a line indented 4 or more columns deeper
    than the line it follows continues that line."""
    lines: list[str] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if lines and line.strip() and indent >= len(lines[-1]) - len(lines[-1].lstrip(" ")) + 4:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`gguf-trainer ARGS` to its end, its output captured: a warm process where it can be one (warm_runs.py's
    WARM_COMMANDS), else a cold one."""
    return trainer_run(list(args), capture_output=True, text=True, env=cli_env(), timeout=timeout)


def _build_finished_project(tmp_path_factory, worker_id, demo_materials_root) -> tuple[Path, float]:
    def build(folder: Path) -> str:
        root = new_demo_project(folder, demo_materials_root, **FAULT_SETTINGS).root
        start = time.perf_counter()
        trainer_run(["run", str(root)], env=cli_env(), check=True, capture_output=True, timeout=600)
        return str(time.perf_counter() - start)

    root, seconds = built_once(tmp_path_factory, worker_id, "reference", build)
    return root, float(seconds)


@pytest.fixture(scope="session")
def finished_project(tmp_path_factory, worker_id, demo_materials_root) -> tuple[Path, float]:
    """A project folder after one uninterrupted `gguf-trainer run` under FAULT_SETTINGS, and its seconds; built
    once for the whole suite. Never changed: a test that changes a project works on ``copy_project`` of it."""
    return _build_finished_project(tmp_path_factory, worker_id, demo_materials_root)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, worker_id) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's first command, `gguf-trainer demo DIR`, run once for the whole suite (its 1,000 training steps
    are the suite's longest pipeline): the project folder and what the command printed. Its readers are one
    xdist_group ("demo"), so one worker runs it while the others go on. Never changed: work on ``copy_project``."""

    def build(folder: Path) -> str:
        done = subprocess.run([*CLI, "demo", str(folder / "demo-project")], capture_output=True, text=True,
                              env=cli_env(), timeout=DEMO_GROUP_TIMEOUT_S - 60)
        return json.dumps([done.returncode, done.stdout, done.stderr])

    folder, printed = built_once(tmp_path_factory, worker_id, "demo", build)
    returncode, stdout, stderr = json.loads(printed)
    return folder / "demo-project", subprocess.CompletedProcess(["gguf-trainer", "demo"], returncode, stdout, stderr)


def copy_project(source: Path, dest: Path) -> ProjectPaths:
    """A copy of a project folder (its Dagster history too), stamped by one status question, asked in this process
    as `gguf-trainer status` asks it: a copy has new inodes, which the first status settles by content, so later
    checks are the cheap ones a user's project gets."""
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status.states import project_status

    shutil.copytree(source, dest, symlinks=True)
    paths = ProjectPaths.of(dest)
    project_status(paths, load_settings(dest))
    return paths


@pytest.fixture
def shards_done_project(finished_project, tmp_path) -> ProjectPaths:
    """A copy of the finished project without anything training made (checkpoints, curves, outputs): the folder as
    `run` leaves it once its shard step is done, for tests whose point comes in training or later. Its Dagster
    history keeps the finished project's runs, as a user's does after a new training setting."""
    paths = copy_project(finished_project[0], tmp_path / "shards-done")
    for made_by_training in ("checkpoints", "tensorboard", "output"):
        shutil.rmtree(paths.root / made_by_training)
    return paths


class _Reference:
    """``(outputs, seconds)`` of the reference run, made on first use: a test that compares its outputs only at its
    end starts at once instead of waiting for the reference to be built (by it or by another worker)."""

    def __init__(self, make) -> None:
        self._make, self._value = make, None

    def _get(self) -> tuple[dict[str, bytes], float]:
        if self._value is None:
            root, seconds = self._make()
            outputs = pipeline_outputs(root)
            # 5 shards x 2 halves, the final weights, the GGUFs ggk loads (the adapter, the student, the vision encoder)
            assert len(outputs) == 5 * 2 + 1 + 3
            self._value = outputs, seconds
        return self._value

    def __getitem__(self, index):
        return self._get()[index]

    def __iter__(self):
        return iter(self._get())


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, worker_id, demo_materials_root) -> _Reference:
    """The outputs of one uninterrupted `gguf-trainer run` under FAULT_SETTINGS, and its seconds (the finished
    project's), unpacked or indexed as ``(outputs, seconds)`` when the test needs them."""
    return _Reference(lambda: _build_finished_project(tmp_path_factory, worker_id, demo_materials_root))


@pytest.fixture
def fingerprint_callers(monkeypatch):
    """A Counter of the functions that call lib/core/atomic.py ``fingerprint`` (each stage's fingerprint function
    calls it once per computation), counted from now on."""
    import sys
    from collections import Counter

    from gguf_assets.lib.core import atomic

    callers: Counter = Counter()
    fingerprint = atomic.fingerprint

    def counted(value):
        callers[sys._getframe(1).f_code.co_name] += 1
        return fingerprint(value)

    monkeypatch.setattr(atomic, "fingerprint", counted)
    return callers


def project_instance(paths: ProjectPaths):
    """The project's own Dagster instance, opened as the CLI opens it: its dagster.yaml holds no
    path, so DAGSTER_HOME (set here for the rest of the test; make_project restores it) says where."""
    import dagster as dg

    from gguf_assets.orchestration.instance import prepare_instance

    prepare_instance(paths)
    return dg.DagsterInstance.get()


def wait_for(predicate, *, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll ``predicate`` until it holds; fail early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            said = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {said}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def stop_with_ctrl_c(proc: subprocess.Popen, *, what: str, timeout: float = 30) -> None:
    """Ctrl-C to a server we started; it must end within ``timeout`` (killed, and the test fails, otherwise)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not stop within {timeout:.0f} s of Ctrl-C") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, *, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited early: {proc.stdout.read() if proc.stdout else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout}s")


def create_run_with_status(instance, *, status, tags: dict[str, str]):
    """A run record with these tags and status, as a run of a trivial job (what the sensors see)."""
    import dagster as dg

    @dg.op
    def nothing() -> None:
        pass

    @dg.job
    def a_run():
        nothing()

    return instance.create_run_for_job(a_run, status=status, tags=tags)


# The longest tests first, so the xdist workers end together instead of one waiting on a long test that started
# last. Their seconds (setup, call and teardown) are in durations.json, updated by a run with
# GGUF_ASSETS_RECORD_DURATIONS=1 (`GGUF_ASSETS_RECORD_DURATIONS=1 bash scripts/test.sh`); a test not in it counts as
# short. A module whose module-scoped fixture is costly (a `gguf-trainer ui`, a browser, a pipeline) is one
# xdist_group: scripts/test.sh's --dist loadgroup runs it on one worker, which builds the fixture once, instead of on
# each worker that takes one of its tests; the group comes at the place of its tests' summed seconds.
DURATIONS_FILE = Path(__file__).with_name("durations.json")
_RECORDED: dict[str, float] = {}


def _plain_id(nodeid: str) -> str:
    """A test's id without the "@group" that xdist's loadgroup appends (its own rule for finding it)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None and mark.args else None


# The README demo (conftest's demo_run: 1,200 steps of a 128-wide adapter since #55) is built by the first of its
# group's tests to run, inside that test's time limit: on a loaded 2-core machine it took up to 10 minutes.
DEMO_GROUP_TIMEOUT_S = 1500


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _group(item) == "demo":
            item.add_marker(pytest.mark.timeout(DEMO_GROUP_TIMEOUT_S))
    try:
        seconds = json.loads(DURATIONS_FILE.read_text())
    except (OSError, ValueError):
        return
    own = {item.nodeid: seconds.get(_plain_id(item.nodeid), 0.0) for item in items}
    grouped: dict[str, float] = {}
    for item in items:
        if (group := _group(item)) is not None:
            grouped[group] = grouped.get(group, 0.0) + own[item.nodeid]
    # Stable: a group's tests stay together, the rest keep their order.
    items.sort(key=lambda item: -grouped.get(_group(item), own[item.nodeid]))


def pytest_runtest_logreport(report):
    if os.environ.get("GGUF_ASSETS_RECORD_DURATIONS") == "1":
        nodeid = _plain_id(report.nodeid)
        _RECORDED[nodeid] = _RECORDED.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    # On the controller (or a single process): the workers' reports reach it too.
    if os.environ.get("GGUF_ASSETS_RECORD_DURATIONS") == "1" and not hasattr(session.config, "workerinput"):
        try:
            known = json.loads(DURATIONS_FILE.read_text())
        except (OSError, ValueError):
            known = {}
        known.update({k: round(v, 1) for k, v in _RECORDED.items()})
        kept = dict(sorted(((k, v) for k, v in known.items() if v >= 3.0), key=lambda kv: -kv[1]))
        DURATIONS_FILE.write_text(json.dumps(kept, indent=1) + "\n")
