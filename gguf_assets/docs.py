"""Docs generated from code: `python -m gguf_assets.docs` rewrites docs/settings.md, and the key tables of
docs/gguf_layout.md between their markers.

A test fails when a committed file differs from what this generates, so they cannot drift.
"""

import re
import sys
from pathlib import Path

from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.output.gguf_format import metadata_key_rows
from gguf_assets.lib.project.settings import settings_reference_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"
SETTINGS_DOC = DOCS / "settings.md"
GGUF_LAYOUT_DOC = DOCS / "gguf_layout.md"
# A generated region: <!-- generated: NAME (python -m gguf_assets.docs) --> ... <!-- end generated: NAME -->
_REGION = re.compile(r"(<!-- generated: (?P<name>[a-z ]+) \(python -m gguf_assets\.docs\) -->\n)(?P<body>.*?)"
                     r"(<!-- end generated: (?P=name) -->)", re.S)


def gguf_key_tables() -> dict[str, str]:
    fixed, provenance = metadata_key_rows()
    return {"fixed keys": markdown_table(("key", "GGUF type", "meaning"), fixed),
            "provenance keys": markdown_table(("key", "type", "required", "meaning"), provenance)}


def with_generated_regions(text: str, tables: dict[str, str]) -> str:
    """``text`` with each marked region's body replaced by its table; ValueError naming a table with no region."""
    missing = set(tables) - {m["name"] for m in _REGION.finditer(text)}
    if missing:
        raise ValueError(f"no generated region for {sorted(missing)}")
    return _REGION.sub(lambda m: f"{m.group(1)}{tables[m['name']]}\n{m.group(4)}", text)


def gguf_layout_markdown() -> str:
    return with_generated_regions(GGUF_LAYOUT_DOC.read_text(encoding="utf-8"), gguf_key_tables())


def main() -> int:
    SETTINGS_DOC.write_text(settings_reference_markdown() + "\n", encoding="utf-8")
    GGUF_LAYOUT_DOC.write_text(gguf_layout_markdown(), encoding="utf-8")
    print(f"wrote {SETTINGS_DOC} and {GGUF_LAYOUT_DOC}'s key tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
