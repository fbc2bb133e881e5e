"""Is a process that once ran a pipeline step still alive? (boot id + pid)

A run cut off by a reboot or a kill -9 stays STARTED in Dagster forever under the default
run launcher; these facts let us tell such a run from a live one.
"""

from __future__ import annotations

from pathlib import Path

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """Changes at every boot (Linux); '' where unknown."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """A stable id of this machine (a hash of systemd's machine id, or of the boot id where there is none):
    it names no host, and tells whether a pid recorded elsewhere means anything here."""
    import hashlib

    for source in (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id")):
        try:
            text = source.read_text().strip()
        except OSError:
            continue
        if text:
            return hashlib.sha256(text.encode()).hexdigest()[:16]
    return hashlib.sha256(boot_id().encode()).hexdigest()[:16]


def process_alive(pid: int) -> bool:
    """True while process ``pid`` runs (also one owned by another user); a zombie (killed, not yet reaped by its
    parent) counts as gone."""
    import psutil

    if not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ended since (psutil.ZombieProcess is one too)
        return False
    except psutil.Error:  # AccessDenied: it exists, and we may not look
        return True


def process_started(pid: int) -> str:
    """The process's start time as a string ('' if it does not exist): a pid alone can be reused."""
    import psutil

    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except psutil.Error:
        return ""


def holder_is_gone(*, holder_boot_id: str, holder_pid: int | None, holder_started: str = "") -> bool:
    """True if the holder ran before this boot, or its process no longer exists (or the pid was reused)."""
    current = boot_id()
    if holder_boot_id and current and holder_boot_id != current:
        return True
    if holder_pid is None:
        return False
    if not process_alive(holder_pid):
        return True
    return bool(holder_started) and process_started(holder_pid) not in ("", holder_started)
