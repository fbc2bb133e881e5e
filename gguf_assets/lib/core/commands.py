"""Command lines the tool prints for the user to paste: they name the console script beside this Python,
so they work from a shell where the virtualenv is not activated (`.venv/bin/gguf-trainer …`), and every word is
quoted for the shell (`shell_line`), so a project folder named `my runs` or `$(touch x)` pastes as itself."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def venv_tool(name: str) -> str:
    """The console script installed beside this Python, or the bare name when there is none."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def shell_line(*words: object) -> str:
    """One command line for a POSIX shell: each word quoted where it needs it (the one quoting of the product)."""
    return " ".join(shlex.quote(str(word)) for word in words)


def trainer(*args: object) -> str:
    """A `gguf-trainer …` command line that works when pasted."""
    return shell_line(venv_tool("gguf-trainer"), *args)
