"""The student's tokenizer as ggk rebuilds it: from merges alone (tokenizers/qwen2_tokenizer.cpp).

ggk's Qwen2 tokenizer takes no vocabulary file. It numbers the 256 byte symbols in GPT-2's bytes_to_unicode
order, then one token per merge (the two halves joined), then its fixed special tokens, and splits text with
Qwen2's pre-tokenizer regex (tokenize_util.cpp). A student whose tokenizer numbers its tokens otherwise gets
other ids from ggk than from transformers, so the product checks the student's tokenizer.json against that rule
before any precompute (``ggk_tokenizer_problem``), and writes the merges as the tokenizer pack ggk's
``--tokenizer-pack DIR`` reads (``write_tokenizer_pack``).
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.ggk_contract import BYTE_SYMBOLS, TOKENIZER_PACK_MERGES

# tokenize_util.cpp, token_split ("qwen2:"), the same pattern as Qwen2's tokenizer.json Split pre-tokenizer.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_symbols() -> list[str]:
    """The 256 byte symbols in ggk's id order (bpe_tokenizer.cpp, bytes_to_unicode: the printable bytes first,
    then the rest mapped from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(rest))]


def ggk_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Token -> id as ggk numbers them from ``merges`` (its special tokens follow, not listed here)."""
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))  # ggk's map keeps the last id for a repeated token: see the check
    return vocab


def qwen2_pre_tokenizer():
    """tokenizers' pre-tokenizer that splits as ggk does: Qwen2's regex, then the byte-level map."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def tokenizer_from_merges(merges: list[tuple[str, str]], *, specials: list[str]):
    """A tokenizers.Tokenizer numbered as ggk numbers ``merges``, with ``specials`` after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = ggk_vocab(merges)
    if len(vocab) != BYTE_SYMBOLS + len(merges):
        raise ValueError("the merges make a token twice; ggk would number it otherwise")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=None))
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _merges_of(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def ggk_tokenizer_problem(folder: Path) -> str | None:
    """Why ggk would tokenize differently from the student's ``tokenizer.json`` in ``folder``, or None.

    ggk reproduces a byte-level BPE whose ids are its merges' order (above); the product then encodes with ggk's
    own splitter (``GgkTokenizer``), whatever pre-tokenizer the file names.
    """
    file = Path(folder) / "tokenizer.json"
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{file} cannot be read ({exc}); ggk rebuilds the tokenizer from its merges, so it is needed"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"{file}: the model is {model.get('type')!r}, but ggk runs a byte-level BPE (Qwen2's)"
    merges = _merges_of(model)
    expected = ggk_vocab(merges)
    vocab = model.get("vocab") or {}
    wrong = [t for t, i in expected.items() if vocab.get(t) != i]
    if wrong or len(expected) != BYTE_SYMBOLS + len(merges):
        shown = ", ".join(f"{t!r} is {vocab.get(t)} here, {expected[t]} in ggk" for t in wrong[:3])
        return (f"{file}: ggk numbers the tokens from the merges alone (256 byte symbols, then one per merge), "
                f"and {len(wrong)} tokens differ ({shown})")
    return None


def write_tokenizer_pack(folder: Path, pack_dir: Path) -> Path:
    """Write the student's merges as ggk's tokenizer pack (``pack_dir``/qwen2/merges.txt), atomically; return it.
    One merge a line, each ended by a newline (ggk's reader keeps only lines that end in one)."""
    spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    text = "".join(f"{a} {b}\n" for a, b in _merges_of(spec["model"]))
    target = Path(pack_dir) / TOKENIZER_PACK_MERGES
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(target, text.encode("utf-8"))
    return target


# ------------------------------------------------------------------------------------------ ggk's encoder, ported
# ggk's tokenizer is not HF's: its hand-written Qwen2 splitter (tokenize_util.cpp, token_split) differs from the
# regex on "'d" (never a contraction), on "'S" (lowered), on digits (ASCII only), on non-ASCII spaces, and it reads
# letters from its own Unicode table. The student is fed ggk's ids, so the product encodes with this port.
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|boi_token|>", "<|bor_token|>", "<|eor_token|>", "<|bot_token|>", "<|tms_token|>")
UNKNOWN_ID = 151643  # qwen2_tokenizer.cpp: UNK_TOKEN_ID
_SPACES = frozenset((0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000))
_C_SPACES = frozenset((0x9, 0xA, 0xB, 0xC, 0xD, 0x20))  # the C library's isspace, which one rule calls
_NEWLINES = (0xA, 0xD)


def _letter_test():
    import bisect

    from gguf_assets.lib.materials.ggk_letters import LETTER_RANGES

    starts = [a for a, _ in LETTER_RANGES]

    def is_letter(cp: int) -> bool:
        i = bisect.bisect_right(starts, cp) - 1
        return i >= 0 and cp <= LETTER_RANGES[i][1]
    return is_letter


def _is_number(cp: int) -> bool:
    return 0x30 <= cp <= 0x39


def token_split(text: str, is_letter) -> list[str]:
    """tokenize_util.cpp's token_split, rule for rule (its comments give the regex each rule stands for)."""
    cps = [ord(c) for c in text]
    n, i, out = len(cps), 0, []

    def run(j: int, more) -> int:
        while j < n and more(cps[j]):
            j += 1
        return j

    def punct(cp: int) -> bool:
        return not is_letter(cp) and not _is_number(cp) and cp not in _C_SPACES

    while i < n:
        cp = cps[i]
        if cp == 0x27 and i + 1 < n:  # (?i:'s|'t|'re|'ve|'m|'ll|'d), ASCII-lowered; "'d" never matches there
            nxt = text[i + 1].lower() if cps[i + 1] < 128 else text[i + 1]
            if nxt in ("s", "t", "m"):
                out.append("'" + nxt)
                i += 2
                continue
            if i + 2 < n:
                nxt += text[i + 2].lower() if cps[i + 2] < 128 else text[i + 2]
                if nxt in ("re", "ve", "ll", "d"):
                    out.append("'" + nxt)
                    i += 3
                    continue
        if _is_number(cp):  # \p{N}, ASCII digits only
            out.append(text[i])
            i += 1
            continue
        if is_letter(cp) or (cp not in _NEWLINES and i + 1 < n and is_letter(cps[i + 1])):  # [^\r\n\p{L}\p{N}]?\p{L}+
            j = run(i + 1, is_letter)
            out.append(text[i:j])
            i = j
            continue
        if cp == 0x20 and i + 1 < n and punct(cps[i + 1]):  # ` ?[^\s\p{L}\p{N}]+[\r\n]*`, with the space
            j = run(run(i + 2, punct), lambda c: c in _NEWLINES)
            out.append(text[i:j])
            i = j
            continue
        if punct(cp):  # the same without the space
            j = run(run(i + 1, punct), lambda c: c in _NEWLINES)
            out.append(text[i:j])
            i = j
            continue
        if cp in _SPACES:  # \s*[\r\n]+|\s+(?!\S)|\s+ over the whitespace run
            j = run(i, lambda c: c in _SPACES)
            newlines = [k for k in range(i, j) if cps[k] in _NEWLINES]
            end = newlines[-1] + 1 if newlines else (j - 1 if j < n and j - i > 1 else j)
            out.append(text[i:end])
            i = end
            continue
        i += 1  # skipped
    return out


class GgkTokenizer:
    """ggk's Qwen2 tokenizer over ``merges`` (bpe_tokenizer.cpp, encode): special tokens first, then the splitter,
    the byte map and BPE by merge rank. ``encode`` gives the ids ggk feeds the student."""

    def __init__(self, merges: list[tuple[str, str]]) -> None:
        self.byte_map = byte_symbols_by_byte()
        self.vocab = ggk_vocab(merges)
        for special in QWEN2_SPECIAL_TOKENS:
            self.vocab[special] = len(self.vocab)
        self.ranks = {tuple(m): r for r, m in enumerate(merges)}
        self.is_letter = _letter_test()
        self._words: dict[str, list[int]] = {}

    @classmethod
    def of_folder(cls, folder: Path) -> "GgkTokenizer":
        spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
        return cls(_merges_of(spec["model"]))

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            ranked = [(self.ranks[pair], k) for k, pair in enumerate(zip(parts, parts[1:])) if pair in self.ranks]
            if not ranked:
                break
            first, second = parts[min(ranked)[1]], parts[min(ranked)[1] + 1]
            merged, k = [], 0
            while k < len(parts):
                if k + 1 < len(parts) and parts[k] == first and parts[k + 1] == second:
                    merged.append(first + second)
                    k += 2
                else:
                    merged.append(parts[k])
                    k += 1
            parts = merged
        return parts

    def _word_ids(self, word: str) -> list[int]:
        ids = self._words.get(word)
        if ids is None:
            symbols = "".join(self.byte_map[b] for b in word.encode("utf-8"))
            ids = self._words[word] = [self.vocab.get(p, UNKNOWN_ID) for p in self._bpe(symbols)]
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, special in _split_specials(text):
            if special:
                ids.append(self.vocab[piece])
                continue
            for word in token_split(piece, self.is_letter):
                ids += self._word_ids(word)
        return ids


def _split_specials(text: str) -> list[tuple[str, bool]]:
    """tokenize_util.cpp, split_with_special_tokens: the earliest special token splits the text, repeatedly."""
    out, pos = [], 0
    while pos < len(text):
        found = [(k, s) for s in QWEN2_SPECIAL_TOKENS if (k := text.find(s, pos)) >= 0]
        if not found:
            out.append((text[pos:], False))
            break
        k, special = min(found, key=lambda f: (f[0], QWEN2_SPECIAL_TOKENS.index(f[1])))
        if k > pos:
            out.append((text[pos:k], False))
        out.append((special, True))
        pos = k + len(special)
    return out


def byte_symbols_by_byte() -> dict[int, str]:
    """Byte -> its symbol (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(161, 173), *range(174, 256)]
    order = printable + [b for b in range(256) if b not in printable]
    return dict(zip(order, byte_symbols()))
