"""ggk's contract, in one place: what the runtime feeds the student, how it runs the student and the adapter,
and the names it loads them under. Precompute, training, export, evaluation and the docs all read these facts
from here; none of them spells one again.

Every fact is ggk 0.9.7's (PyPI ``ggk``, MIT), read in its engine source ``vendor/engine/diffusion/src/``; the
file each comes from is named beside it. The suite checks them against the engine itself
(gguf_assets_tests/ggk/), built from that sdist.

No torch and no numpy here: `status`, the settings and the torch-free evaluator import this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GGK_VERSION = "0.9.7"

# ----------------------------------------------------------------------------------------------- conditioning
# conditioning/conditioner.hpp, get_learned_condition, the sd_version_is_llada_image branch.
LLADA_IMAGE = "llada-image"
CONDITIONINGS = (LLADA_IMAGE,)
LLADA_PREFIX = "<role>HUMAN</role> Generate an image:"       # then " " + text, parsed for emphasis
LLADA_EMPTY_PREFIX = "<role>HUMAN</role> Generate an image."  # the empty prompt: prefix and suffix only
LLADA_SUFFIX = "\n<role>ASSISTANT</role>\n<IMAGE1>"


@dataclass(frozen=True)
class Piece:
    """One run of text that ggk BPE-tokenizes on its own (conditioner.hpp, tokenize: each parsed piece is
    encoded separately, with no special tokens), and the emphasis weight ggk gives its tokens."""

    text: str
    weight: float = 1.0


def llada_image_pieces(text: str) -> list[Piece]:
    """The pieces ggk tokenizes for the prompt ``text`` under LLaDA-Image, in order.

    conditioner.hpp: the empty prompt is rendered in one piece (its attention range is empty); any other is the
    prefix up to the colon, then " " + text through the emphasis parser (the space belongs to the text piece, so
    "Ġa" stays one token), then the suffix. ggk takes the text as given: no strip.
    """
    if not text:
        return [Piece(LLADA_EMPTY_PREFIX + LLADA_SUFFIX)]
    return [Piece(LLADA_PREFIX), *parse_prompt_attention(" " + text), Piece(LLADA_SUFFIX)]


def rendered_prompt(text: str) -> str:
    """The whole string ggk renders for ``text`` (what the pieces spell before the emphasis parser)."""
    return LLADA_EMPTY_PREFIX + LLADA_SUFFIX if not text else f"{LLADA_PREFIX} {text}{LLADA_SUFFIX}"


# core/util.cpp, parse_prompt_attention (AUTOMATIC1111's prompt parser), reproduced token for token, quirks
# included: of the escapes only `\(` loses its backslash (`\)`, `\[`, `\]` and `\\` stay as typed), and BREAK becomes
# a piece of weight -1. ggk searches the text left after each match as a string of its own, so `\b` holds at its
# start: a `B` inside a word is kept (`\bB`), and "xBREAK y" breaks after the x. The weight is read by std::stof,
# which takes the longest number at the start ("1.2.3" is 1.2). std::regex's ECMAScript grammar on bytes sees
# non-ASCII as non-word characters, as re.ASCII does.
_ATTENTION = re.compile(r"\\\(|\\\)|\\\[|\\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|\]|\bBREAK\b|[^\\()\[\]:B]+|:|\bB",
                        re.ASCII)
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.ASCII)
ROUND_MULTIPLIER = 1.1
BREAK_WEIGHT = -1.0


_STOF_PREFIX = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)", re.ASCII)


def _stof(text: str) -> float:
    """std::stof: the longest number at the start of ``text``. None (".") is ggk's uncaught invalid_argument: it
    aborts on such a prompt, so the weight is NaN here, which emphasis_problem reports like any other weight (the
    student still reads the text)."""
    number = _STOF_PREFIX.match(text)
    return _f32(float(number.group(0))) if number else math.nan


def _f32(x: float) -> float:
    """Round to float32 as ggk's `float` arithmetic does, so equal weights merge as they do there."""
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]


def parse_prompt_attention(text: str) -> list[Piece]:
    """ggk's emphasis parser: ``text`` as pieces of equal weight (adjacent equal weights merged)."""
    pieces: list[list] = []
    round_open: list[int] = []
    square_open: list[int] = []
    square_multiplier = _f32(1 / _f32(ROUND_MULTIPLIER))

    def multiply(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] = _f32(piece[1] * factor)

    remaining = text
    while match := _ATTENTION.search(remaining):  # std::regex_search on what is left, as a string of its own
        token, weight = match.group(0), match.group(1)
        remaining = remaining[match.end():]
        if token == "(":
            round_open.append(len(pieces))
        elif token == "[":
            square_open.append(len(pieces))
        elif weight:
            if round_open:
                multiply(round_open.pop(), _stof(weight))
        elif token == ")" and round_open:
            multiply(round_open.pop(), _f32(ROUND_MULTIPLIER))
        elif token == "]" and square_open:
            multiply(square_open.pop(), square_multiplier)
        elif token == "\\(":
            pieces.append([token[1:], 1.0])
        elif _BREAK.search(token):
            pieces.append(["BREAK", BREAK_WEIGHT])
        else:
            pieces.append([token, 1.0])
    for start in round_open:
        multiply(start, _f32(ROUND_MULTIPLIER))
    for start in square_open:
        multiply(start, square_multiplier)
    if not pieces:
        pieces.append(["", 1.0])
    merged: list[list] = [pieces[0]]
    for piece in pieces[1:]:
        if piece[1] == merged[-1][1]:
            merged[-1][0] += piece[0]
        else:
            merged.append(piece)
    return [Piece(t, w) for t, w in merged]


def emphasis_problem(text: str) -> str | None:
    """Why ggk 0.9.7 aborts on ``text`` with a resampler adapter, or None: a piece with a weight other than 1
    (conditioner.hpp:95, apply_token_weights' GGML_ASSERT: the resampler's output has query rows, not tokens)."""
    weighted = [p for p in llada_image_pieces(text) if p.weight != 1.0]
    if not weighted:
        return None
    shown = ", ".join(f"{p.text!r} x{p.weight:.3g}" for p in weighted[:3])
    return (f"ggk {GGK_VERSION} reads emphasis in it ({shown}) and aborts with a resampler adapter; escape each "
            r"bracket with a backslash (`\(`, `\)`, `\[`, `\]`) and avoid the word BREAK")


ESCAPE_HINT = (rf"ggk {GGK_VERSION} reads ( ) [ ] and BREAK in a prompt as emphasis and aborts on it with this "
               r"adapter: write `a \(red\) cat`, not `a (red) cat`")

# ---------------------------------------------------------------------------------------------------- student
# model/te/llm.hpp: ggk reads the student's sizes from its tensors and fixes the rest. A student built otherwise
# computes other states in ggk, so the product refuses it (lib/materials/student/contract.py).
STUDENT_HEAD_DIM = 128
STUDENT_RMS_NORM_EPS = 1e-6
STUDENT_ROPE_THETA = 1_000_000.0
STUDENT_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
# gk-diffuser.cpp / model_loader.cpp: `--llm` tensors keep their HF names (model.*), loaded under this prefix.
STUDENT_TENSOR_PREFIX = "text_encoders.llm."
# The adapter reads the student's final-norm hidden states at every template position, with no key mask
# (conditioner.hpp: out_layers cleared for LLaDA-Image).
STUDENT_LAYER = -1

# -------------------------------------------------------------------------------------------------- tokenizer
# tokenizers/qwen2_tokenizer.cpp: the vocabulary is rebuilt from merges.txt alone (the 256 byte symbols in
# GPT-2's bytes_to_unicode order, then one id per merge); `--tokenizer-pack DIR` reads DIR/qwen2/merges.txt.
TOKENIZER_PACK_MERGES = "qwen2/merges.txt"
BYTE_SYMBOLS = 256

# ---------------------------------------------------------------------------------------------------- adapter
# model/te/llm_adapter.hpp: the seedless resampler (trainer8 / LLaDA-Image). Tensors are the torch state-dict
# names under ADAPTER_PREFIX in the file; which ones exist picks the variant (`query`: a resampler; `t5_embed*`:
# seeded; no `query`: token-aligned; `vision_proj`/`vis_in`: the vision extension; `layer_map`: layerwise).
ADAPTER_PREFIX = "adapter."
ADAPTER_LOADED_AS = "text_encoders.llm_adapter."
ADAPTER_HEAD_DIM = 64          # LLMAdapter::HEAD_DIM: heads = width / 64
ADAPTER_LAYER_NORM_EPS = 1e-5  # torch's default, fixed in the engine
ADAPTER_MLP_RATIO = 4          # ggk reads the MLP width from blocks.0.mlp.0.weight; the product trains 4 x width
ADAPTER_GELU = "erf"           # ggml_gelu_erf: torch's exact nn.GELU()
RESAMPLER_SEEDLESS = "resampler (seedless)"
ADAPTER_VARIANTS = ("resampler",)  # ggk's token-aligned, seeded and layerwise variants can be added beside it


def adapter_log_line(*, in_dim: int, out_dim: int, width: int, depth: int, queries: int) -> str:
    """The start of the line ggk logs when it loads a seedless resampler (llm_adapter.hpp, detect_from_weights)."""
    return (f"llm adapter: {RESAMPLER_SEEDLESS} in={in_dim} out={out_dim} width={width} depth={depth} "
            f"heads={width // ADAPTER_HEAD_DIM} queries={queries}")


# ----------------------------------------------------------------------------------------------------- vision
# model/te/sigvq.hpp: the SigVQ encoder's tensors keep their HF names, under this prefix in the engine.
VISION_LOADED_AS = "sigvq."

# ------------------------------------------------------------------------------------------------ the command
# The wrapper's CLI (`ggk diffuser engine -- ...` runs the engine binary with the rest of the line).
GGK_COMMAND = ('ggk diffuser engine -- --diffusion-model {dit_gguf} --vae {vae_gguf} --llm {student_gguf} '
               '--llm-adapter {adapter_gguf} --llm_vision {vision_gguf} --tokenizer-pack {tokenizer_pack} '
               '-p "a cat"')
# Files the user brings (the image model): shown as placeholders to fill.
USER_FILES = {"dit_gguf": "<your LLaDA-Image DiT .gguf>", "vae_gguf": "<your LLaDA-Image VAE .gguf>"}
# SD_DUMP_COND=<dir> makes the engine write what it computed (conditioner.hpp).
DUMP_ENV = "SD_DUMP_COND"
DUMP_TOKENS = "tokens.txt"
DUMP_STUDENT_STATES = "qwen_hidden.bin"
DUMP_ADAPTER_OUT = "adapter_out.bin"
