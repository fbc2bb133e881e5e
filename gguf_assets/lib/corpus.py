"""Corpus: read prompt sources, clean, dedupe, split into train/val with empty (CFG) prompts.

Deterministic for a seed: the same sources and settings give byte-identical files.
Bad input is reported with file:line and the fix, never as a bare traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gguf_assets.lib import atomic
from gguf_assets.lib.layout import SPLITS, ProjectPaths
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

PROMPT_SUFFIXES = (".jsonl", ".txt", ".json")


class CorpusError(ValueError):
    """Bad prompt input; names the file (and line) and the fix."""


def clean(text: str) -> str:
    return unicodedata.normalize("NFC", text).strip()


def _read_jsonl(file: Path, text_field: str) -> Iterator[str]:
    with open(file, encoding="utf-8-sig") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{file}:{line_no}: not valid JSON ({exc.msg}). Each line must be an object "
                                  f'like {{"{text_field}": "a prompt"}}.') from None
            value = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(value, str):
                raise CorpusError(f"{file}:{line_no}: key {text_field!r} is missing or not a string "
                                  f"(got {type(value).__name__}). Each line needs a string {text_field!r}.")
            yield value


def _read_txt(file: Path) -> Iterator[str]:
    with open(file, encoding="utf-8-sig", newline=None) as fh:
        yield from (line.rstrip("\n") for line in fh)


def _read_json(file: Path, text_field: str) -> Iterator[str]:
    try:
        data = json.loads(file.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg}). A .json prompt file must hold a list "
                          f"of strings or objects with {text_field!r}.") from None
    if not isinstance(data, list):
        raise CorpusError(f"{file}: a .json prompt file must hold a list of strings or objects with {text_field!r}.")
    for i, item in enumerate(data):
        value = item.get(text_field) if isinstance(item, dict) else item
        if not isinstance(value, str):
            raise CorpusError(f"{file}: item {i}: expected a string or an object with a string {text_field!r}.")
        yield value


def read_prompt_file(file: Path, *, text_field: str = "text") -> Iterator[str]:
    if not file.is_file():
        raise CorpusError(f"{file}: prompt file not found. Fix the path in corpus.local_prompt_files.")
    try:
        if file.suffix == ".jsonl":
            yield from _read_jsonl(file, text_field)
        elif file.suffix == ".json":
            yield from _read_json(file, text_field)
        else:
            yield from _read_txt(file)
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{file}: not UTF-8 (bad byte at offset {_bad_byte_offset(file, exc.start)}). "
                          "Re-save the file as UTF-8.") from None


def _bad_byte_offset(file: Path, fallback: int) -> int:
    """Offset of the first invalid UTF-8 byte in the whole file.

    A text-mode reader decodes in chunks, so its UnicodeDecodeError.start is relative to
    the chunk, not the file; decoding the bytes again (only on this error path) gives the
    real offset. A BOM is valid UTF-8, so offsets count it like any other bytes.
    """
    try:
        file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return fallback


def _dataset_files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in PROMPT_SUFFIXES)
    if not files:
        raise CorpusError(f"{folder}: no prompt files ({', '.join(PROMPT_SUFFIXES)}) in this dataset folder.")
    return files


def iter_sources(paths: ProjectPaths, settings: Settings, materials: dict) -> Iterator[tuple[str, Path, str]]:
    """(source label, file, text_field) for every prompt file, in a fixed order."""
    for ds in materials.get("datasets", []):
        for file in _dataset_files(Path(ds["path"])):
            yield ds["source"], file, ds.get("text_field") or "text"
    for value in settings.corpus.local_prompt_files:
        yield value, paths.resolve_local(value), "text"


def empty_count(n: int, fraction: float) -> int:
    """Empty prompts in a split of n: round(n * fraction), at least one when fraction > 0."""
    return 0 if fraction <= 0 else max(1, round(n * fraction))


def build_corpus(paths: ProjectPaths, settings: Settings, materials: dict, *, fingerprint: str) -> dict:
    """Write corpus/train.jsonl, corpus/val.jsonl and corpus/manifest.json; return the manifest."""
    c = settings.corpus
    sources = list(iter_sources(paths, settings, materials))
    for _, file, _ in sources:  # cheap existence check before any reading
        if not file.is_file():
            raise CorpusError(f"{file}: prompt file not found. Fix the path in corpus.local_prompt_files.")
    seen: set[bytes] = set()
    kept: list[str] = []
    counts = Counter()
    per_source: Counter = Counter()
    lengths = Counter()
    for label, file, text_field in sources:
        read_here = 0
        for raw in read_prompt_file(file, text_field=text_field):
            read_here += 1
            text = clean(raw)
            if not text:
                counts["dropped_blank"] += 1
                continue
            if not c.min_chars <= len(text) <= c.max_chars:
                counts["dropped_length"] += 1
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if digest in seen:
                counts["dropped_duplicate"] += 1
                continue
            seen.add(digest)
            kept.append(text)
            per_source[label] += 1
            lengths[min(len(text) // 50, 20)] += 1
        counts["read"] += read_here
        if read_here == 0:
            raise CorpusError(f"{file}: the file holds no prompts. Remove it from the sources or fill it.")

    need = {split: getattr(c, f"{split}_prompts") for split in SPLITS}
    empties = {split: empty_count(n, c.empty_fraction) for split, n in need.items()}
    text_needed = sum(need[s] - empties[s] for s in SPLITS)
    if len(kept) < text_needed:
        raise CorpusError(f"corpus: {len(kept)} usable prompts after cleaning, but train_prompts + val_prompts need "
                          f"{text_needed} non-empty prompts. Lower corpus.train_prompts/val_prompts or add sources.")
    rng = random.Random(c.seed)
    rng.shuffle(kept)
    splits: dict[str, list[str]] = {}
    start = 0
    for split in ("val", "train"):  # val first, so growing train_prompts keeps the val set fixed
        n_text = need[split] - empties[split]
        prompts = kept[start:start + n_text] + [""] * empties[split]
        start += n_text
        rng.shuffle(prompts)
        splits[split] = prompts

    manifest = {"fingerprint": fingerprint, "counts": dict(counts, kept=len(kept), unused=len(kept) - text_needed),
                "per_source": dict(per_source), "length_histogram_50chars": {str(k * 50): v for k, v in sorted(lengths.items())},
                "splits": {}}
    for split in SPLITS:
        body = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in splits[split])
        atomic.write_text(paths.corpus_file(split), body)
        manifest["splits"][split] = {"prompts": len(splits[split]), "empty": empties[split],
                                     "sha256": hashlib.sha256(body.encode()).hexdigest()}
    atomic.write_json(paths.corpus_manifest, manifest)
    log.info("corpus: %d train, %d val prompts from %d kept (%s)", need["train"], need["val"], len(kept), dict(counts))
    return manifest


def read_split(paths: ProjectPaths, split: str) -> list[str]:
    with open(paths.corpus_file(split), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def shard_prompts(prompts: list[str], shard_size: int) -> list[list[str]]:
    return [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
