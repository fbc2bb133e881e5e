"""Terminal output in 80 columns: prose wrapped at its spaces, a pasteable command kept whole.

A command the tool prints for pasting (lib/core/commands.py shell_line, quoted in backticks inside prose) is one
unit here: it moves to a line of its own when it does not fit, and stays whole there even when it is longer than
the line, since a command broken over two lines no longer pastes.
"""

from __future__ import annotations

import re

WIDTH = 80
# A word, where a `...` span (spaces and all) and what is glued to it ("(`…`)," say) count as one word.
_WORD = re.compile(r"[^\s`]*`[^`]*`[^\s`]*|\S+")


def wrap(text: str, *, hanging: int = 4, width: int = WIDTH) -> list[str]:
    """``text`` (one logical line) as lines of at most ``width`` columns, broken at spaces only: the first keeps
    the text's own indent, the next ones are indented ``hanging`` columns more. A word longer than a line (a
    command in backticks, a long path) stands alone on its line, whole."""
    indent = len(text) - len(text.lstrip(" "))
    lines, line, end = [], text[:indent], indent
    for match in _WORD.finditer(text, indent):
        gap, word, end = text[end:match.start()], match.group(), match.end()  # the text's own spacing, kept
        if line.strip() and len(line) + len(gap) + len(word) > width:
            lines.append(line)
            line = " " * (indent + hanging) + word
        else:
            line += gap + word
    lines.append(line)
    return lines


def fill(text: str, *, hanging: int = 4, width: int = WIDTH) -> str:
    """``wrap``'s lines as one string, each logical line of ``text`` wrapped on its own."""
    return "\n".join(wrapped for line in text.splitlines() or [""]
                     for wrapped in wrap(line, hanging=hanging, width=width))
