"""Docs generated from code: `python -m gguf_assets.docs` rewrites docs/settings.md, and the generated regions of
docs/gguf_layout.md between their markers: the key tables and the tensor table (from lib/output/gguf_format.py and
lib/core/ggk_contract.py) and the forward math (the docstring of lib/training/adapter.py, read without importing
torch).

A test fails when a committed file differs from what this generates, so they cannot drift.
"""

import ast
import re
import sys
import textwrap
from pathlib import Path

from gguf_assets.lib.core.ggk_contract import ADAPTER_LOADED_AS, ADAPTER_MLP_RATIO, ADAPTER_PREFIX
from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.output.gguf_format import (
    TRAINING_ONLY,
    expected_tensor_shapes,
    hparams_of,
    is_f16_tensor,
    metadata_key_rows,
    tensor_name,
)
from gguf_assets.lib.project.settings import settings_reference_markdown

PACKAGE = Path(__file__).resolve().parent
DOCS = PACKAGE.parent / "docs"
SETTINGS_DOC = DOCS / "settings.md"
GGUF_LAYOUT_DOC = DOCS / "gguf_layout.md"
ADAPTER_SOURCE = PACKAGE / "lib" / "training" / "adapter.py"
# A generated region: <!-- generated: NAME (python -m gguf_assets.docs) --> ... <!-- end generated: NAME -->
_REGION = re.compile(r"(<!-- generated: (?P<name>[a-z ]+) \(python -m gguf_assets\.docs\) -->\n)(?P<body>.*?)"
                     r"(<!-- end generated: (?P=name) -->)", re.S)

# What each module of the resampler is, for the tensor table (a module missing here gets no words, not an error).
_MODULE_HELP = {
    "query": "the Q learned query rows",
    "in_proj": "the student's states into the width",
    "ln_self": "LayerNorm before the self-attention",
    "self_attn": "self-attention over the Q rows",
    "ln_q": "LayerNorm of the rows before the cross-attention",
    "ln_kv": "LayerNorm of the student's projected states before the cross-attention",
    "cross_attn": "cross-attention from the rows to the student's tokens",
    "ln_mlp": "LayerNorm before the MLP",
    "mlp.0": "MLP in (GELU, erf, after it)",
    "mlp.2": "MLP out",
    "ln_out": "LayerNorm of the rows before the output",
    "out_proj": "the output, the standardization folded in: it gives the conditioning directly",
}


def gguf_key_tables() -> dict[str, str]:
    fixed, provenance = metadata_key_rows()
    return {"fixed keys": markdown_table(("key", "GGUF type", "meaning"), fixed),
            "provenance keys": markdown_table(("key", "type", "required", "meaning"), provenance)}


def _module_of(key: str) -> str:
    """``blocks.N.self_attn.{q,k,v,o}.weight`` -> ``self_attn``; ``blocks.N.mlp.0.bias`` -> ``mlp.0``."""
    module = re.sub(r"^blocks\.N\.", "", key).rpartition(".")[0] or key
    return module if module in _MODULE_HELP else module.split(".")[0]


def gguf_tensor_table() -> str:
    """Every tensor of the file (a block's as ``blocks.N``, q/k/v/o together) with its ``ne`` in symbols, its type,
    and what it is, in file order; then the count and the names ggk loads them under."""
    # Sizes told apart by value: the symbols are read back from the shapes gguf_format gives.
    symbols = {3: "Ds", 5: "Q", 7: "D", 64: "W", ADAPTER_MLP_RATIO * 64: f"{ADAPTER_MLP_RATIO}W"}

    def shapes(depth: int) -> dict[str, tuple[int, ...]]:
        return expected_tensor_shapes(hparams_of(student_dim=3, query_rows=5, target_dim=7, width=64, depth=depth,
                                                 mlp_ratio=ADAPTER_MLP_RATIO))

    rows: dict[str, list[str]] = {}
    for key, shape in shapes(1).items():
        generic = re.sub(r"_attn\.[qkvo]\.", "_attn.{q,k,v,o}.", re.sub(r"^blocks\.0\.", "blocks.N.", key))
        ne = "[" + ", ".join(symbols[n] for n in reversed(shape)) + "]"
        row = [f"`{tensor_name(key).replace(key, generic)}`", ne, "F16*" if is_f16_tensor(key) else "F32",
               _MODULE_HELP.get(_module_of(generic), "")]
        if rows.setdefault(generic, row) != row:
            raise ValueError(f"{generic}: its q/k/v/o tensors differ in shape or type; list them one by one")
    one, two = len(shapes(1)), len(shapes(2))
    per_block = two - one
    lines = [markdown_table(("GGUF name", "ne", "type", "what"), rows.values()), "",
             f"N runs over `0 … depth-1`. Tensor count = `{one - per_block} + {per_block} * depth`. ggk loads each "
             f"tensor under `{ADAPTER_LOADED_AS}` in place of `{ADAPTER_PREFIX}`. The checkpoint's training "
             f"statistics ({', '.join(f'`{k}`' for k in TRAINING_ONLY)}) are not in the file."]
    return "\n".join(lines)


def adapter_forward_math() -> str:
    """The forward math as lib/training/adapter.py's docstring states it: its indented block and its ``attn(``
    paragraph, in a code fence."""
    doc = ast.get_docstring(ast.parse(ADAPTER_SOURCE.read_text(encoding="utf-8"))) or ""
    paragraphs = doc.split("\n\n")
    block = next((p for p in paragraphs if p.startswith("    ")), None)
    attn = next((p for p in paragraphs if p.startswith("attn(")), None)
    if block is None or attn is None:
        raise ValueError(f"{ADAPTER_SOURCE}'s docstring must hold the forward math as an indented block and a "
                         "paragraph starting `attn(`: docs/gguf_layout.md copies them")
    return "```\n" + textwrap.dedent(block).strip("\n") + "\n\n" + attn.strip("\n") + "\n```"


def gguf_layout_tables() -> dict[str, str]:
    """Every generated region of docs/gguf_layout.md, by name."""
    return {**gguf_key_tables(), "tensor table": gguf_tensor_table(), "forward math": adapter_forward_math()}


def with_generated_regions(text: str, tables: dict[str, str]) -> str:
    """``text`` with each marked region's body replaced by its table; ValueError naming a table with no region."""
    missing = set(tables) - {m["name"] for m in _REGION.finditer(text)}
    if missing:
        raise ValueError(f"no generated region for {sorted(missing)}")
    return _REGION.sub(lambda m: f"{m.group(1)}{tables[m['name']]}\n{m.group(4)}", text)


def gguf_layout_markdown() -> str:
    return with_generated_regions(GGUF_LAYOUT_DOC.read_text(encoding="utf-8"), gguf_layout_tables())


def main() -> int:
    SETTINGS_DOC.write_text(settings_reference_markdown() + "\n", encoding="utf-8")
    GGUF_LAYOUT_DOC.write_text(gguf_layout_markdown(), encoding="utf-8")
    print(f"wrote {SETTINGS_DOC} and {GGUF_LAYOUT_DOC}'s generated regions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
