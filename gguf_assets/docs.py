"""Docs generated from code: `python -m gguf_assets.docs` rewrites docs/settings.md.

A test fails when the committed file differs from what this generates, so it cannot drift.
"""

import sys
from pathlib import Path

from gguf_assets.lib.project.settings import settings_reference_markdown

SETTINGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def main() -> int:
    SETTINGS_DOC.write_text(settings_reference_markdown() + "\n", encoding="utf-8")
    print(f"wrote {SETTINGS_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
