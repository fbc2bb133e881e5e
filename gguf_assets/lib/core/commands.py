"""Command lines the tool prints for the user to paste: they name the console script beside this Python,
so they work from a shell where the virtualenv is not activated (`.venv/bin/gguf-trainer …`)."""

from __future__ import annotations

import sys
from pathlib import Path


def venv_tool(name: str) -> str:
    """The console script installed beside this Python, or the bare name when there is none."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def trainer(*args: object) -> str:
    """A `gguf-trainer …` command line that works when pasted."""
    return " ".join([venv_tool("gguf-trainer"), *(str(a) for a in args)])
