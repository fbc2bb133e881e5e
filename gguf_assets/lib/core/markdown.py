"""Markdown text, built one way everywhere: every table escapes its cells the same way, and text from the
user's data (a prompt, a file name) is shown as it is. The settings reference (docs/settings.md), the report,
the UI's metadata tables and the generated docs all use it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_MARKDOWN_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]<>#"} | {"\r": " ", "\t": " "})


def cell(value: object) -> str:
    """A table cell: pipes escaped and newlines flattened, so a value never breaks the row."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def user_text(text: str, limit: int = 160) -> str:
    """Text from the user's data (a prompt, a file name) shown as it is: Markdown specials escaped, cut at ``limit``."""
    short = text if len(text) <= limit else text[:limit - 1] + "…"
    return short.translate(_MARKDOWN_SPECIAL)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], *, right: Iterable[int] = ()) -> str:
    """A table; ``right`` lists the columns (by index) aligned right, e.g. counts."""
    right = set(right)
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", rule]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
