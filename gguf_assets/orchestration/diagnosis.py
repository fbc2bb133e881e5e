"""What an error of the project's own Dagster storage (<project>/.dagster, SQLite) means for the user: a full
disk, or a damaged file, each with what to do."""

from __future__ import annotations

import contextlib
import shutil

from gguf_assets.lib.core.commands import shell_line, trainer
from gguf_assets.lib.project.layout import ProjectPaths

LOW_DISK_MIB = 16  # below this, a storage error is taken for a full disk


def dagster_storage_problem(project: str | None, exc: BaseException) -> str | None:
    """The message for an error of the project's Dagster SQLite storage (.dagster): a full disk, or a damaged
    file; None when ``exc`` is not that."""
    import sqlite3

    text = str(exc)
    if not project or not any(s in text for s in ("malformed", "not a database", "disk I/O", "disk is full")):
        return None
    paths = ProjectPaths.of(project)
    home = paths.root / ".dagster"
    free_mib = shutil.disk_usage(home if home.exists() else paths.root).free / 2**20
    if "disk is full" in text or free_mib < LOW_DISK_MIB:
        return (f"No space left on the disk holding {paths.root} ({free_mib:.0f} MiB free): Dagster could not "
                f"record the run in {home}. Everything finished so far is kept. Free some space, then "
                f"`{trainer('run', paths.root)}` continues (the run cut off now is then "
                "recorded as failed).")
    damaged = []
    for db in sorted(home.rglob("*.db")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
                ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        except sqlite3.DatabaseError as db_exc:
            ok = "malformed" not in str(db_exc) and "not a database" not in str(db_exc)
        if not ok:
            damaged.append(db)
    if not damaged:
        return None
    names = ", ".join(str(d) for d in damaged)
    return (f"Dagster's run history is damaged: {names} ({text.splitlines()[0]}). Your results are in the "
            f"project's files, not there, and nothing computed is lost. Move the history away and run again: "
            f"`{shell_line('mv', home, f'{home}.damaged')} && {trainer('run', paths.root)}` (every finished stage is "
            "found current and kept; only the list of past runs starts afresh).")
