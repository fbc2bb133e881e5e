"""The operating system refusing a write, through the real CLI: one line that says what refused (a
read-only folder, a full disk), what the command needed to write and the fix; exit code 2, no traceback.

The read-only folder is a real one: the project is bind-mounted onto itself and remounted read-only in
a mount namespace of the command's own (`unshare -m`, or `unshare -rm` where only user namespaces are
allowed), which refuses writes to root too (a chmod does not), and vanishes with the command. The full
disk is a 256 KiB tmpfs, filled, in the same way. The project is a cheap one in the state a run leaves
(Dagster's storage made, the lock taken once, the materials recorded), without running a pipeline.
"""

import errno
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import CLI, cli_env, free_port, new_demo_project, unwrapped
from warm_runs import trainer_run

from gguf_assets.lib.core.errors import os_refusal_message
from gguf_assets.lib.core.lock import ProjectLock

pytestmark = [pytest.mark.slow,  # every command through the real CLI, in mount namespaces (about 25 s)
              pytest.mark.xdist_group("os_refusals")]  # on one worker: the used project is made once (conftest.py)

# $1: the folder; the rest: the command. 97: no mount here; 98: the folder still took a write.
READ_ONLY = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" || exit 97; '
             'if touch "$1/.write-probe" 2>/dev/null; then exit 98; fi; shift; exec "$@"')
FULL_DISK = ('mount -t tmpfs -o size=256k tmpfs "$1" || exit 97; head -c 1M /dev/zero > "$1/filler" 2>/dev/null; '
             'shift; exec "$@"')


@functools.cache
def _namespace() -> list[str] | None:
    """`unshare -m` (root with CAP_SYS_ADMIN) or `unshare -rm` (an unprivileged user namespace), or None."""
    with tempfile.TemporaryDirectory() as folder:
        for command in (["unshare", "-m"], ["unshare", "-rm"]):
            try:
                if subprocess.run([*command, "sh", "-c", READ_ONLY, "sh", folder, "true"], capture_output=True,
                                  timeout=30).returncode == 0:
                    return command
            except (OSError, subprocess.TimeoutExpired):
                pass
    return None


def in_namespace(script: str, folder: Path, *args: str) -> subprocess.CompletedProcess:
    namespace = _namespace()
    if namespace is None:
        pytest.skip("no mount namespace here (`unshare -m` and `unshare -rm` both refused)")
    done = subprocess.run([*namespace, "sh", "-c", script, "sh", str(folder), *CLI, *args], capture_output=True,
                          text=True, env=cli_env(), timeout=180)
    assert done.returncode not in (97, 98), (done.returncode, done.stderr)  # mounted, and really read-only
    return done


def one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    """The command ended with exit code 2 and exactly one line on stderr, naming every needle."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (done.returncode, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr and "sqlalchemy" not in done.stderr.lower()
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def used_project(tmp_path_factory, demo_materials_root) -> Path:
    """A project as a run leaves it, without a pipeline: Dagster's storage, the lock files, the materials record."""
    from gguf_assets.lib.materials.pinning.resolve import resolve_materials
    from gguf_assets.lib.project.settings import load_settings

    paths = new_demo_project(tmp_path_factory.mktemp("read-only") / "project", demo_materials_root, steps=5,
                             mock_teacher=True)
    trainer_run(["env", str(paths.root)], env=cli_env(), check=True, capture_output=True, timeout=120)
    with ProjectLock(paths.lock_file, describe="the test"):
        pass
    resolve_materials(paths, load_settings(paths.root))
    assert (paths.dagster_home / ".storage-created").is_file() and paths.materials_manifest.is_file()
    return paths.root


READ_ONLY_REFUSALS = {
    # command: what it needs to write first (`status`, `runs`, `verify` and `estimate` only read: see below)
    "run": ".dagster (Dagster's record of the runs)",
    "ui": ".dagster/services.lock (the lock that keeps one studio and one Dagster daemon per project)",
    "auto-resume": ".dagster (Dagster's record of the runs)",
    "--auto-resume": ".dagster (Dagster's record of the runs)",  # the flag the subcommand replaced still works
}


@pytest.mark.parametrize("command", READ_ONLY_REFUSALS)
def test_a_read_only_project_is_one_line_for_every_command_that_writes(used_project, command):
    root = used_project
    args = {"run": ["run", str(root)],
            "ui": ["ui", str(root), "--no-tensorboard", "--no-daemon", "--port", str(free_port()),
                   "--studio-port", str(free_port())],
            "auto-resume": ["auto-resume", str(root), "--no-daemon"],
            "--auto-resume": ["--auto-resume", str(root), "--no-daemon"]}[command]
    done = in_namespace(READ_ONLY, root, *args)
    named = command.removeprefix("--")
    one_line(done, f"{root} is read-only (its file system is mounted read-only at {root})",
             f"`gguf-trainer {named}` needs to write {root}/{READ_ONLY_REFUSALS[command]}",
             f"Remount {root} read-write, or copy the project to a place you can write and use the copy: "
             f"`cp -a {root} NEW && ", f"gguf-trainer {named} NEW`.")


def test_reading_commands_work_on_a_read_only_project_and_a_repair_is_one_line(used_project, tmp_path):
    """`status`, `runs`, `estimate` and `verify` only read: they answer as usual. `verify --repair` must write its
    marks."""
    root = used_project
    done = in_namespace(READ_ONLY, root, "status", str(root))  # asks who holds the lock without writing its files
    assert done.returncode == 0 and done.stdout.startswith("  materials ") and not done.stderr, done.stdout + \
        done.stderr
    done = in_namespace(READ_ONLY, root, "runs", str(root))
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0 and "has no training runs yet" in said, done.stdout + done.stderr
    done = in_namespace(READ_ONLY, root, "estimate", str(root))
    assert done.returncode == 0 and "peak on one GPU" in done.stdout, done.stdout + done.stderr
    done = in_namespace(READ_ONLY, root, "verify", str(root))
    assert done.returncode == 0 and "materials    ok" in done.stdout, done.stdout + done.stderr

    copy = tmp_path / "damaged"
    shutil.copytree(root, copy, symlinks=True)
    weights = copy / "materials" / "demo" / "student" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    done = in_namespace(READ_ONLY, copy, "verify", str(copy), "--repair")
    assert "damaged" in done.stdout, done.stdout
    one_line(done, f"{copy} is read-only", f"`gguf-trainer verify` needs to write {copy}/materials/manifest.json",
             f"cp -a {copy} NEW")


def test_a_finished_project_copied_to_read_only_media_reads_and_run_is_refused_at_once(finished_project, tmp_path):
    """A copy (new inodes: its first status checks the files by content, and cannot keep the new stamps) on a
    file system mounted read-only: status, runs and verify answer as on the original; run is one line, at once."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_project[0], copy, symlinks=True)
    done = in_namespace(READ_ONLY, copy, "status", str(copy))
    states = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    assert states == dict.fromkeys(("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf",
                                    "eval_report"), "current"), done.stdout
    done = in_namespace(READ_ONLY, copy, "runs", str(copy))
    assert done.returncode == 0 and "finished" in done.stdout and "current" in done.stdout, done.stdout + done.stderr
    done = in_namespace(READ_ONLY, copy, "verify", str(copy))
    assert done.returncode == 0 and "0 damaged, 0 missing" in done.stdout, done.stdout + done.stderr
    done = in_namespace(READ_ONLY, copy, "run", str(copy))
    one_line(done, f"{copy} is read-only (its file system is mounted read-only at {copy})",
             f"`gguf-trainer run` needs to write {copy}/.dagster", f"cp -a {copy} NEW")
    assert done.stdout.strip() in ("", "starting: loading the pipeline"), done.stdout  # refused before anything ran


def test_init_into_a_read_only_folder_or_a_full_disk_is_one_line(used_project, tmp_path):
    root = used_project
    done = in_namespace(READ_ONLY, root, "init", str(root / "new"))
    one_line(done, f"{root} is read-only", f"`gguf-trainer init` needs to write {root}/new (the project folder)",
             f"Remount {root} read-write, or choose a folder you can write: `", "gguf-trainer init NEW`.")
    assert not (root / "new").exists()

    disk = tmp_path / "disk"
    disk.mkdir()
    done = in_namespace(FULL_DISK, disk, "init", str(disk / "project"))
    one_line(done, f"No space left on the disk holding {disk}", "MiB free",
             f"`gguf-trainer init` needs to write {disk}/project", "Free some space")


def test_permission_and_immutability_refusals_read_as_such(tmp_path):
    """Root passes permission bits, so these are the messages for errors as the OS raises them."""
    project = tmp_path / "p"
    project.mkdir()
    (project / "project.yaml").write_text("{}\n")
    denied = PermissionError(errno.EACCES, "Permission denied", str(project / ".dagster" / "runs.db"))
    message = os_refusal_message(denied, project=project, command="run")
    assert message.startswith(f"Permission denied: {project} (drwx") and "may not be written by" in message
    assert f"`gguf-trainer run` needs to write {project}/.dagster/runs.db (Dagster's record of the runs)" in message
    assert f"chmod -R u+w {project}" in message and f"cp -a {project} NEW" in message
    immutable = PermissionError(errno.EPERM, "Operation not permitted", str(project / "project.yaml"))
    message = os_refusal_message(immutable, project=project, command="init")
    assert message.startswith(f"Operation not permitted on {project}/project.yaml") and "chattr -i -a" in message
    # Not a file: a refused signal or socket is no refusal to write, and goes on as before.
    assert os_refusal_message(PermissionError(errno.EPERM, "Operation not permitted"), project=project,
                              command="run") is None
    assert os_refusal_message(ValueError("x"), project=project, command="run") is None
    # Wrapped in another error (a library re-raising it): found by its cause.
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", str(project / ".tmp-project.yaml.abc123"))
        except OSError as exc:
            raise RuntimeError("could not save") from exc
    except RuntimeError as wrapped:
        message = os_refusal_message(wrapped, project=project, command="init")
    assert message and f"needs to write {project}/project.yaml (the settings)" in message, message
