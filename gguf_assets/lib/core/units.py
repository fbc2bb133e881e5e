"""How the product writes a size in bytes for a person: one formatter, so the CLI, the studio and the estimate
say the same size the same way."""

from __future__ import annotations


def bytes_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, one decimal: "1.5 GiB", "12.0 KiB", "512 bytes"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
