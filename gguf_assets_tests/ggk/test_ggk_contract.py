"""lib/core/ggk_contract.py and the tokenizer's letter table against the source of the ggk engine the suite builds
(ggk_build.py keeps the unpacked sdist): a fact the contract module states that ggk's source does not fails here."""

from __future__ import annotations

import re

from ggk_build import GGK_VERSION, ggk_binary, source_dir

from gguf_assets.lib.core import ggk_contract
from gguf_assets.lib.materials.ggk_letters import LETTER_RANGES


def engine_source(relative: str) -> str:
    ggk_binary()  # fetches and builds once per machine (the source comes with it)
    return (source_dir() / "vendor" / "engine" / "diffusion" / "src" / relative).read_text()


def test_the_contract_module_holds_what_the_engine_source_says():
    """ggk_contract.py and the letter table against the sdist the binary was built from."""
    assert ggk_contract.GGK_VERSION == GGK_VERSION
    conditioner = engine_source("conditioning/conditioner.hpp")
    for text in (ggk_contract.LLADA_PREFIX, ggk_contract.LLADA_EMPTY_PREFIX):
        assert f'"{text}"' in conditioner
    assert '"\\n<role>ASSISTANT</role>\\n<IMAGE1>"' in conditioner
    adapter = engine_source("model/te/llm_adapter.hpp")
    assert f"HEAD_DIM = {ggk_contract.ADAPTER_HEAD_DIM};" in adapter
    table = engine_source("tokenizers/tokenize_util.cpp")
    body = table[table.index("bool is_letter"):table.index("bool is_space")]
    ranges = tuple((int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+),\s*0x([0-9A-Fa-f]+)\}", body))
    assert ranges == LETTER_RANGES


def test_the_emphasis_parser_and_the_special_tokens_are_ggks():
    """The parser's pattern is ggk's, character for character, and so is the special-token list the port appends."""
    from gguf_assets.lib.materials.ggk_tokenizer import QWEN2_SPECIAL_TOKENS

    util = engine_source("core/util.cpp")
    pattern = re.search(r'std::regex re_attention\(R"\((.*)\)"\);', util).group(1)
    assert pattern == ggk_contract._ATTENTION.pattern
    listed = engine_source("tokenizers/qwen2_tokenizer.cpp")
    body = listed[listed.index("qwen2_special_tokens()"):listed.index("return tokens;")]
    assert tuple(re.findall(r'"([^"]+)"', body)) == QWEN2_SPECIAL_TOKENS
