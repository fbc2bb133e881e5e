"""The hub package: it exports what the rest of the product uses of it, and nothing else."""

import ast
from pathlib import Path

import gguf_assets
from gguf_assets.lib.materials import hub

PACKAGE = Path(gguf_assets.__file__).parent
HUB_FOLDER = Path(hub.__file__).parent


def _names_the_product_takes_from_hub() -> set[str]:
    """Every ``hub.<name>`` and ``from ...hub import <name>`` in gguf_assets/ outside the hub package itself."""
    taken = set()
    for file in PACKAGE.rglob("*.py"):
        if HUB_FOLDER in file.parents:
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "gguf_assets.lib.materials":
                aliases |= {a.asname or a.name for a in node.names if a.name == "hub"}
            elif isinstance(node, ast.ImportFrom) and node.module == hub.__name__:
                taken |= {a.name for a in node.names}
        taken |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id in aliases}
    return taken


def test_the_package_exports_what_the_product_uses():
    """No module class swap and no names kept for the tests: a test imports a name from the module that defines
    it, and replaces it where it is looked up."""
    taken = _names_the_product_takes_from_hub()
    assert {"HubOptions", "download", "token_from_env"} <= taken  # the scan sees both ways of taking a name
    assert sorted(hub.__all__) == sorted(taken)
    assert all(hasattr(hub, name) for name in hub.__all__)
    assert type(hub) is type(ast)  # a plain module: setting hub.<name> sets it in the package only
