"""Saving project.yaml without losing anybody's edit.

A page (the studio's forms, its text editor, a preset applied there) edits the file as it was when the page
read it. Meanwhile the user may save the same file in an editor. A save therefore names the text it was built
from by its sha256, and is refused when the file is no longer that text: the user sees what changed and
decides, instead of one of the two edits silently vanishing.

The check and the write happen under an flock on <project>/.dagster/settings.lock (one saver at a time across
the studio's requests and processes), and the file is compared once more at the last moment before the atomic
rename: an editor knows nothing of our lock. The rename itself is a swap (Linux renameat2 RENAME_EXCHANGE) that
hands back the file it replaced: when that is not the text the save was built from, an editor saved in between,
and its file is swapped back, so even a save that lands in the same instant as the editor's loses neither.
"""

from __future__ import annotations

import difflib
import fcntl
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError

LOCK_NAME = "settings.lock"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SettingsText:
    text: str
    sha256: str


def read(project_file: Path) -> SettingsText:
    text = Path(project_file).read_text(encoding="utf-8")
    return SettingsText(text, text_sha256(text))


class SettingsChanged(UserError):
    """project.yaml is no longer the text a save was built from."""

    def __init__(self, project_file: Path, current: SettingsText, diff: str) -> None:
        self.current, self.diff = current, diff
        super().__init__(f"{project_file} changed since this page read it (saved from an editor or another page), so "
                         "this save was not written, and neither edit is lost. Reload to see the file as it is now, "
                         "then make your change again." + (f"\nWhat changed in the file:\n{diff}" if diff else ""))


class SeenTexts:
    """The last few project.yaml texts a page was given, by sha256: what a refused save is diffed against."""

    KEPT = 32

    def __init__(self) -> None:
        self._texts: OrderedDict[str, str] = OrderedDict()

    def remember(self, seen: SettingsText) -> SettingsText:
        self._texts[seen.sha256] = seen.text
        self._texts.move_to_end(seen.sha256)
        while len(self._texts) > self.KEPT:
            self._texts.popitem(last=False)
        return seen

    def get(self, sha256: str) -> str | None:
        return self._texts.get(sha256)


def _diff(before: str | None, after: str, name: str) -> str:
    if before is None:
        return ""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=f"{name} (as this page read it)", tofile=f"{name} (now)", n=1))


def save_if_unchanged(project_file: Path, lock_dir: Path, new_text: str, base_sha256: str,
                      seen: SeenTexts | None = None) -> SettingsText:
    """Write ``new_text`` atomically if project.yaml still has the sha256 ``base_sha256``; SettingsChanged (with
    the file as it is now, and what changed since the base when ``seen`` remembers it) otherwise."""
    project_file = Path(project_file)
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a kill -9

        def refuse_if_changed(expected: os.stat_result | None = None) -> os.stat_result:
            status = os.stat(project_file)
            current = read(project_file)
            if current.sha256 != base_sha256 or (expected is not None and _moved(expected, status)):
                raise SettingsChanged(project_file, current,
                                      _diff(seen.get(base_sha256) if seen else None, current.text, project_file.name))
            return status

        def swap_unless_changed(tmp: Path, final: Path) -> None:
            if not atomic.exchange(tmp, final):  # no swap on this system: the last look is all there is
                os.replace(tmp, final)
                return
            # tmp now holds what project.yaml was at the swap itself: an editor that saved after the last look
            # gets its file back, and this save is refused.
            if _moved(at_read, os.stat(tmp)) or read(tmp).sha256 != base_sha256:
                atomic.exchange(tmp, final)
                refuse_if_changed(at_read)  # raises: the file back in place is the editor's, not the one read
            tmp.unlink()  # the text this save replaced

        at_read = refuse_if_changed()
        with atomic.atomic_path(project_file, before_replace=lambda: refuse_if_changed(at_read),
                                replace=swap_unless_changed) as tmp:
            tmp.write_text(new_text, encoding="utf-8")
    saved = SettingsText(new_text, text_sha256(new_text))
    if seen is not None:
        seen.remember(saved)
    return saved


def _moved(before: os.stat_result, after: os.stat_result) -> bool:
    return (before.st_ino, before.st_size, before.st_mtime_ns) != (after.st_ino, after.st_size, after.st_mtime_ns)
