"""What ggk feeds the student, as the product computes it: the emphasis parser and the LLaDA-Image pieces
(lib/core/ggk_contract.py), and the port of ggk's tokenizer (lib/materials/ggk_tokenizer.py) against the HF
tokenizer of the same merges: equal on the demo's prompts, different exactly where ggk's splitter is."""

from __future__ import annotations

import math

import pytest

from gguf_assets.lib.core.ggk_contract import (
    LLADA_EMPTY_PREFIX,
    LLADA_PREFIX,
    LLADA_SUFFIX,
    Piece,
    emphasis_problem,
    llada_image_pieces,
    parse_prompt_attention,
    rendered_prompt,
)
from gguf_assets.lib.demo.demo import EOS_TOKEN, iter_prompts
from gguf_assets.lib.materials.ggk_tokenizer import GgkTokenizer, ggk_tokenizer_problem, token_split

F32_1_1 = 1.100000023841858  # ggk's 1.1f


def pieces(text: str) -> list[tuple[str, float]]:
    return [(p.text, p.weight) for p in parse_prompt_attention(text)]


# -- the emphasis parser (ggk's core/util.cpp) --------------------------------------------------------------

def test_the_parser_gives_the_examples_of_ggks_comment_as_its_code_does():
    """The examples above parse_prompt_attention in ggk's core/util.cpp, with ggk's float weights. One differs
    from the comment there: the code keeps the backslash of `\\]` (only `\\(` loses it), so that is tested."""
    assert pieces("normal text") == [("normal text", 1.0)]
    assert pieces("an (important) word") == [("an ", 1.0), ("important", F32_1_1), (" word", 1.0)]
    assert pieces("(unbalanced") == [("unbalanced", F32_1_1)]
    assert pieces("\\(literal\\]") == [("(literal\\]", 1.0)]  # the comment says '(literal]'
    assert pieces("(unnecessary)(parens)") == [("unnecessaryparens", F32_1_1)]
    got = pieces("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).")
    assert [t for t, _ in got] == ["a ", "house", " ", "on", " a ", "hill", ", sun, ", "sky", "."]
    assert [w for _, w in got] == pytest.approx([1.0, 1.573, 1.1, 1.0, 1.1, 0.55, 1.1, 1.4641, 1.1], rel=1e-6)


def test_the_parser_keeps_ggks_quirks():
    """Escapes other than `\\(` stay as typed; BREAK is a piece of weight -1; an empty text is one empty piece."""
    assert pieces("a \\) \\[ \\\\ b") == [("a \\) \\[ \\\\ b", 1.0)]
    assert pieces("a BREAK b") == [("a ", 1.0), ("BREAK", -1.0), (" b", 1.0)]
    assert pieces("") == [("", 1.0)]
    assert pieces("[quiet]") == [("quiet", pytest.approx(1 / 1.1, rel=1e-6))]


def test_a_capital_b_inside_a_word_is_kept_as_ggk_keeps_it():
    """ggk searches what is left after each match as a string of its own, where `\\b` holds at the start: a B
    after a letter or digit is text (RGB, eBay), and BREAK after one still breaks. (Checked against ggk's own
    function compiled on its own: the product's first port dropped these B's, so the student read "RG", "eay".)"""
    assert pieces("RGB light, eBay, 4B") == [("RGB light, eBay, 4B", 1.0)]
    assert pieces("aBc") == [("aBc", 1.0)]
    assert pieces("xBREAK y") == [("x", 1.0), ("BREAK", -1.0), (" y", 1.0)]
    assert pieces("BREAKfast") == [("BREAKfast", 1.0)]  # no word boundary after the K


def test_the_weight_is_read_as_std_stof_reads_it():
    """std::stof takes the longest number at the start; nothing to read aborts ggk, so here the piece's weight is
    NaN: emphasis_problem reports the prompt like any weighted one, and the student still reads its text."""
    assert pieces("a (b:1.2.3) c") == [("a ", 1.0), ("b", pytest.approx(1.2)), (" c", 1.0)]
    assert pieces("x (y:+0.5) z") == [("x ", 1.0), ("y", 0.5), (" z", 1.0)]
    assert pieces("(x:1.) y") == [("x y", 1.0)]  # a weight of 1 merges with its neighbours
    (_, weight), = [p for p in pieces("(x:.) y") if p[0] == "x"]
    assert math.isnan(weight) and emphasis_problem("(x:.) y")
    assert [p.text for p in parse_prompt_attention("(x:.) y")] == ["x", " y"]


# -- the LLaDA-Image template's pieces (conditioner.hpp) -----------------------------------------------------

def test_the_empty_prompt_is_one_piece_of_prefix_and_suffix():
    assert llada_image_pieces("") == [Piece(LLADA_EMPTY_PREFIX + LLADA_SUFFIX)]
    assert rendered_prompt("") == "<role>HUMAN</role> Generate an image.\n<role>ASSISTANT</role>\n<IMAGE1>"


def test_a_prompt_is_the_prefix_then_space_and_text_then_the_suffix():
    assert llada_image_pieces("a red cat") == [Piece(LLADA_PREFIX), Piece(" a red cat"), Piece(LLADA_SUFFIX)]
    assert LLADA_PREFIX == "<role>HUMAN</role> Generate an image:"
    assert "".join(p.text for p in llada_image_pieces("a red cat")) == rendered_prompt("a red cat")


def test_a_prompt_ending_with_a_period_is_taken_as_given():
    """No strip and no special case: the period stays in the text piece (only the empty prompt ends the prefix
    with one), and so do the text's own spaces."""
    assert llada_image_pieces("a cat.") == [Piece(LLADA_PREFIX), Piece(" a cat."), Piece(LLADA_SUFFIX)]
    assert llada_image_pieces(" a cat. ")[1] == Piece("  a cat. ")
    emphasised = llada_image_pieces("a (red) cat.")
    assert emphasised == [Piece(LLADA_PREFIX), Piece(" a "), Piece("red", F32_1_1), Piece(" cat."),
                          Piece(LLADA_SUFFIX)]


def test_emphasis_problem_names_the_weighted_pieces_and_the_escape():
    assert emphasis_problem("a red cat") is None
    assert emphasis_problem("") is None
    assert emphasis_problem("a \\(red\\) cat") is None  # escaped: weight 1 (the text keeps "\\)")
    assert emphasis_problem("an RGB eBay listing") is None
    problem = emphasis_problem("a (red) cat")
    assert "'red' x1.1" in problem and "aborts with a resampler adapter" in problem and "\\(" in problem
    assert "'BREAK' x-1" in emphasis_problem("day BREAK night")
    assert "x0.909" in emphasis_problem("a [faint] moon")


# -- the tokenizer port against the HF tokenizer of the same merges ------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(demo_materials_root):
    from transformers import AutoTokenizer

    student = demo_materials_root / "student"
    return GgkTokenizer.of_folder(student), AutoTokenizer.from_pretrained(student), demo_materials_root


def test_the_demo_students_tokenizer_is_numbered_as_ggk_numbers_it(tokenizers):
    _, _, root = tokenizers
    assert ggk_tokenizer_problem(root / "student") is None


def test_the_port_agrees_with_hf_on_the_demos_prompts_and_pieces(tokenizers):
    ggk, hf, root = tokenizers
    prompts = list(dict.fromkeys(iter_prompts(root / "dataset")))
    assert len(prompts) > 1000
    for prompt in prompts:
        assert ggk.encode(prompt) == hf(prompt, add_special_tokens=False).input_ids, prompt
    for piece in {p.text for prompt in ("", *prompts[:50]) for p in llada_image_pieces(prompt)}:
        assert ggk.encode(piece) == hf(piece, add_special_tokens=False).input_ids, piece
    assert ggk.encode(EOS_TOKEN) == [hf.eos_token_id]  # the special tokens follow the merges in both


def test_the_port_differs_from_hf_where_ggks_splitter_does(tokenizers):
    """ggk lower-cases a contraction's letter ("IT'S" gives "'s") and never takes "'d" as a contraction: "O'den"
    is "O" + "'den" there (BPE may merge the d with what follows), "O" + "'d" + "en" in HF's regex."""
    ggk, hf, _ = tokenizers

    def hf_ids(text: str) -> list[int]:
        return hf(text, add_special_tokens=False).input_ids

    assert token_split("IT'S", ggk.is_letter) == ["IT", "'s"]
    assert ggk.encode("IT'S") == hf_ids("IT") + hf_ids("'s") != hf_ids("IT'S")
    assert hf.convert_ids_to_tokens(hf_ids("IT'S"))[-1].endswith("S")
    # A word of the vocabulary that starts with d: after an apostrophe ggk still reads it whole.
    word = next(t for t in sorted(ggk.vocab) if t[0] == "d" and len(t) > 1 and t.isascii() and t.isalpha()
                and ggk.encode(t) == [ggk.vocab[t]])
    assert token_split(f"O'{word}", ggk.is_letter) == ["O", f"'{word}"]
    assert ggk.encode(f"O'{word}") == hf_ids("O") + hf_ids("'") + [ggk.vocab[word]] != hf_ids(f"O'{word}")
    assert hf_ids(f"O'{word}") == hf_ids("O") + hf_ids("'d") + hf_ids(word[1:])
    # Where the two splitters agree, so do the ids (lower-case contractions, the other apostrophes).
    for text in ("it's", "we'll", "they're", "I'd", "a 'dark' forest"):
        assert ggk.encode(text) == hf_ids(text), text
