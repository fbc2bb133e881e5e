"""Corpus: clean, dedupe and split the prompt sources into train/val with empty (CFG) prompts.

Sources are the prompt files of each downloaded dataset and ``corpus.local_prompt_files``,
read by lib/corpus/prompt_files.py (formats, gzip, BOM, file:line errors).

Deterministic for a seed: the same sources and settings give byte-identical files.
Bad input is reported with file:line (and the key for JSON) and the fix, never as a bare
traceback; ``corpus.skip_bad_lines`` skips such records instead and counts them.

Memory stays bounded whatever the corpus size: sources are read one record at a time, each
usable prompt goes straight to a spill file on disk as its finished output line, and only
8-byte digests, offsets and lengths stay in memory. Deduplication, the shuffle and the
split then work on those index arrays with numpy, and the outputs are assembled from the
spill file by offset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import unicodedata
from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.corpus.prompt_files import (
    SKIP_HINT,
    CorpusError,
    PromptFile,
    check_file,
    iter_sources,
)
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.manifests import CorpusManifest, MaterialsManifest
from gguf_assets.lib.project.settings import Settings

log = logging.getLogger(__name__)

HISTOGRAM_BINS = 20
PREVIEW_ROWS = 12
PREVIEW_CHARS = 300
BAD_LINE_SAMPLES = 20
_WRITE_SLICE = 1 << 16
WRITE_BUFFER_BYTES = 1 << 20
# The output line format shards and read_split rely on: json.dumps({"text": t}, ensure_ascii=False).
_ENCODE_STR = json.JSONEncoder(ensure_ascii=False).encode
EMPTY_LINE = b'{"text": ""}\n'

# -- building -----------------------------------------------------------------------------

def clean(text: str) -> str:
    """A prompt as the corpus keeps it (``_read_sources`` inlines this in its hot loop)."""
    return unicodedata.normalize("NFC", text).strip()


def empty_count(n: int, fraction: float) -> int:
    """Empty prompts in a split of n: round(n * fraction), at least one when fraction > 0."""
    return 0 if fraction <= 0 else max(1, round(n * fraction))


def _largest_split(text_available: int, asked: int, fraction: float) -> int:
    """The largest split size <= asked whose non-empty part fits in text_available prompts."""
    size = min(asked, int(text_available / (1 - min(fraction, 0.5))) + 2)
    while size > 0 and size - empty_count(size, fraction) > text_available:
        size -= 1
    return size


def _rng(seed: int) -> np.random.RandomState:
    # RandomState's stream is frozen by numpy's compatibility policy (Generator's is not),
    # so a seed gives the same corpus after a numpy upgrade. Hashing admits any int seed.
    words = np.frombuffer(hashlib.sha256(str(seed).encode()).digest(), dtype="<u4")
    return np.random.RandomState(words)


@dataclass
class SourceStats:
    source: str
    file: str
    format: str
    text_field: str
    sha256: str = ""
    read: int = 0
    dropped_blank: int = 0
    dropped_length: int = 0
    dropped_duplicate: int = 0
    skipped_bad_lines: int = 0
    kept: int = 0
    # The file's size, mtime and inode when it was read: later fingerprints reuse sha256 while they match.
    stamp: dict = field(default_factory=dict)


@dataclass
class _Pool:
    """Every length-valid prompt of every source, as line offsets into the spill file."""

    offsets: array = field(default_factory=lambda: array("Q"))
    digests: bytearray = field(default_factory=bytearray)
    source_ids: array = field(default_factory=lambda: array("I"))
    chars: array = field(default_factory=lambda: array("I"))
    end: int = 0
    bad_samples: list = field(default_factory=list)


def _read_sources(sources: list[tuple[str, Path, str]], settings: Settings, spill: BinaryIO,
                  ) -> tuple[_Pool, list[SourceStats]]:
    c = settings.corpus
    lo, hi = c.min_chars, c.max_chars
    normalize, encode, blake2b = unicodedata.normalize, _ENCODE_STR, hashlib.blake2b
    pool, stats = _Pool(), []
    write, add_offset, add_source, add_chars = (spill.write, pool.offsets.append, pool.source_ids.append,
                                                pool.chars.append)
    digests = pool.digests
    end = 0
    for source_id, (label, file, text_field) in enumerate(sources):
        source = PromptFile(file, text_field)
        st = SourceStats(label, str(file), source.format, text_field, stamp=verify.stamp(file))
        read = blank = length = bad = 0
        for value in source.records():
            if type(value) is not str:
                if not c.skip_bad_lines:
                    raise CorpusError(f"{value.message} {SKIP_HINT}")
                bad += 1
                if len(pool.bad_samples) < BAD_LINE_SAMPLES:
                    pool.bad_samples.append(value.message)
                continue
            read += 1
            text = normalize("NFC", value).strip()  # clean(value), inlined
            if not text:
                blank += 1
                continue
            n = len(text)
            if n < lo or n > hi:
                length += 1
                continue
            line = ('{"text": ' + encode(text) + "}\n").encode()
            # 8-byte digests: a false duplicate among 2M prompts has odds of about 1e-7.
            digests += blake2b(line, digest_size=8).digest()
            add_offset(end)
            add_source(source_id)
            add_chars(n)
            write(line)
            end += len(line)
        st.sha256, st.read, st.dropped_blank, st.dropped_length, st.skipped_bad_lines = (
            source.sha256 or "", read, blank, length, bad)
        if read == blank:
            detail = f" ({bad} bad records were skipped)" if bad else " (it is empty or whitespace only)"
            raise CorpusError(f"{file}: the file holds no prompts{detail}. Remove it from the sources or fill it.")
        stats.append(st)
    pool.end = end
    return pool, stats


def _length_histogram(chars: np.ndarray) -> list[dict]:
    """About HISTOGRAM_BINS bins of a round width over the observed lengths (inclusive bounds)."""
    if not len(chars):
        return []
    lo, hi = int(chars.min()), int(chars.max())
    raw_width = max(1, -(-(hi - lo + 1) // HISTOGRAM_BINS))
    width = next(w * 10 ** e for e in range(12) for w in (1, 2, 5) if w * 10 ** e >= raw_width)
    start = lo // width * width
    counts = np.bincount((chars - start) // width)
    return [{"chars_from": start + i * width, "chars_to": start + (i + 1) * width - 1, "prompts": int(n)}
            for i, n in enumerate(counts)]


def build_corpus(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, *,
                 fingerprint: str) -> CorpusManifest:
    """Write corpus/train.jsonl, corpus/val.jsonl and corpus/manifest.json; return the manifest."""
    c = settings.corpus
    sources = list(iter_sources(paths, settings, materials))
    for label, file, text_field in sources:  # cheap checks of every file before any full read
        setting = "corpus.local_prompt_files" if label in c.local_prompt_files else f"the dataset {label!r}"
        check_file(file, text_field=text_field, skip_bad_lines=c.skip_bad_lines, setting=setting)

    need = {split: getattr(c, f"{split}_prompts") for split in SPLITS}
    paths.corpus_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=paths.corpus_dir, prefix=atomic.TEMP_PREFIX + "spill.") as spill:
        pool, stats = _read_sources(sources, settings, spill)
        spill.flush()
        digests = np.frombuffer(pool.digests, dtype="<u8")
        # return_index gives each value's first occurrence, so the earliest source keeps a prompt.
        kept = np.sort(np.unique(digests, return_index=True)[1])
        del digests
        source_ids = np.frombuffer(pool.source_ids, dtype=np.uint32)
        candidates = np.bincount(source_ids, minlength=len(stats))
        kept_per_source = np.bincount(source_ids[kept], minlength=len(stats))
        for i, st in enumerate(stats):
            st.kept, st.dropped_duplicate = int(kept_per_source[i]), int(candidates[i] - kept_per_source[i])
        n_kept = len(kept)

        sizes = _split_sizes(need, n_kept, c)
        empties = {split: empty_count(n, c.empty_fraction) for split, n in sizes.items()}
        rng = _rng(c.seed)
        order = kept[rng.permutation(n_kept)]
        slots: dict[str, np.ndarray] = {}
        start = 0
        for split in ("val", "train"):  # val first, so growing train_prompts keeps the val set fixed
            n_text = sizes[split] - empties[split]
            ids = np.concatenate([order[start:start + n_text], np.full(empties[split], -1, dtype=np.int64)])
            start += n_text
            rng.shuffle(ids)
            slots[split] = ids
        text_used = start

        offsets = np.frombuffer(pool.offsets, dtype=np.uint64).astype(np.int64)
        ends = np.append(offsets[1:], pool.end) if len(offsets) else offsets
        chars = np.frombuffer(pool.chars, dtype=np.uint32)
        split_meta, preview = {}, []
        for split in SPLITS:
            sha256 = _write_split(paths.corpus_file(split), slots[split], spill, offsets, ends)
            split_meta[split] = {"prompts": sizes[split], "empty": empties[split],
                                 **verify.record(paths.corpus_file(split), sha256)}
            for rid in slots[split][:PREVIEW_ROWS]:
                text = "" if rid < 0 else json.loads(os.pread(spill.fileno(), int(ends[rid] - offsets[rid]),
                                                              int(offsets[rid])))["text"]
                preview.append({"split": split, "source": stats[source_ids[rid]].source if rid >= 0 else "(empty)",
                                "chars": len(text), "text": text[:PREVIEW_CHARS]})
        kept_chars = chars[kept]

    per_source: Counter = Counter()
    for st in stats:
        per_source[st.source] += st.kept
    counts = {key: sum(getattr(st, key) for st in stats)
              for key in ("read", "dropped_blank", "dropped_length", "dropped_duplicate", "skipped_bad_lines")}
    counts.update(kept=n_kept, used=text_used, unused=n_kept - text_used)
    manifest = CorpusManifest(
        fingerprint=fingerprint,
        settings=settings.section_dict("corpus"),
        settings_hash=settings_history.remember(paths.root, settings),
        counts=counts,
        per_source=dict(per_source),
        sources=[{**asdict(st), "file": paths.stored(st.file)} for st in stats],
        bad_line_samples=pool.bad_samples,
        length_histogram=_length_histogram(kept_chars),
        length_chars=({"min": int(kept_chars.min()), "median": int(np.median(kept_chars)),
                       "mean": round(float(kept_chars.mean()), 1), "max": int(kept_chars.max())}
                      if n_kept else {}),
        requested=need,
        preview=preview,
        splits=split_meta,
    )
    atomic.write_json(paths.corpus_manifest, manifest.to_json())
    if sizes != need:
        log.warning("corpus: only %d usable prompts; train shrank from %d to %d (corpus.allow_fewer)",
                    n_kept, need["train"], sizes["train"])
    dropped = ", ".join(f"{counts[k]} {k.removeprefix('dropped_').replace('_', ' ')}"
                        for k in ("dropped_blank", "dropped_length", "dropped_duplicate", "skipped_bad_lines")
                        if counts.get(k))
    log.info("corpus: %d train, %d val prompts from %d read, %d kept%s", sizes["train"], sizes["val"],
             counts["read"], n_kept, f" (dropped: {dropped})" if dropped else "")
    return manifest


def _split_sizes(need: dict[str, int], n_kept: int, c) -> dict[str, int]:
    """Split sizes for n_kept usable prompts; too few is an error unless allow_fewer shrinks train."""
    text_need = {split: n - empty_count(n, c.empty_fraction) for split, n in need.items()}
    total = sum(text_need.values())
    if n_kept >= total:
        return dict(need)
    shortage = (f"corpus: {n_kept} usable prompts after cleaning, but train_prompts + val_prompts need {total} "
                f"non-empty prompts ({text_need['train']} train + {text_need['val']} val; "
                "the empty prompts come on top).")
    if not c.allow_fewer:
        raise CorpusError(f"{shortage} Lower corpus.train_prompts / corpus.val_prompts, add prompt sources, or set "
                          "corpus.allow_fewer: true to accept a smaller train split (val keeps its size).")
    train = _largest_split(n_kept - text_need["val"], need["train"], c.empty_fraction)
    if n_kept <= text_need["val"] or train - empty_count(train, c.empty_fraction) < 1:
        raise CorpusError(f"{shortage} corpus.allow_fewer shrinks only train, and val alone needs "
                          f"{text_need['val']} plus at least one prompt for train. Lower corpus.val_prompts or add "
                          "prompt sources.")
    return {"train": train, "val": need["val"]}


def _write_split(final: Path, ids: np.ndarray, spill: BinaryIO, offsets: np.ndarray, ends: np.ndarray) -> str:
    digest = hashlib.sha256()
    fd = spill.fileno()
    with atomic.atomic_path(final) as tmp, open(tmp, "wb", buffering=WRITE_BUFFER_BYTES) as out:
        # In slices, so no Python list of the whole split is ever built.
        for start in range(0, len(ids), _WRITE_SLICE):
            part = ids[start:start + _WRITE_SLICE]
            safe = np.maximum(part, 0)
            for rid, offset, length in zip(part.tolist(), offsets[safe].tolist(),
                                           (ends[safe] - offsets[safe]).tolist()):
                line = EMPTY_LINE if rid < 0 else os.pread(fd, length, offset)
                out.write(line)
                digest.update(line)
    return digest.hexdigest()


def read_split(paths: ProjectPaths, split: str) -> list[str]:
    with open(paths.corpus_file(split), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def shard_prompts(prompts: list[str], shard_size: int) -> list[list[str]]:
    return [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
