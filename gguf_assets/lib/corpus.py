"""Corpus: read prompt sources, clean, dedupe, split into train/val with empty (CFG) prompts.

Sources are the prompt files of each downloaded dataset and ``corpus.local_prompt_files``:
``.txt`` (one prompt per line), ``.jsonl`` (an object per line), ``.json`` (a list of strings
or objects) and ``.csv`` (a header row naming the column), each optionally gzip-compressed
(``.gz`` after the suffix), and ``.parquet`` (a string column; compressed inside the format).
A UTF-8 BOM and CRLF line ends are accepted.

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

import codecs
import contextlib
import csv
import gzip
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import unicodedata
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gguf_assets.lib import atomic, verify
from gguf_assets.lib.errors import UserError
from gguf_assets.lib.layout import SPLITS, ProjectPaths
from gguf_assets.lib.materials import DATASET_METADATA_FILES
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

PROMPT_FORMATS = (".txt", ".jsonl", ".json", ".csv", ".parquet")
GZIP_SUFFIX = ".gz"
PARQUET = ".parquet"
# Rows per parquet batch: with only the text column read, memory is about this many prompts
# plus one row group's compressed column chunk.
PARQUET_BATCH_ROWS = 1024
# One line (or one .json list item) may not exceed this; it bounds memory for a file with
# no newlines at all, while leaving room for JSON records that carry other large fields.
MAX_RECORD_BYTES = 64 << 20
READ_CHUNK_BYTES = 1 << 20
# Records read from the start of each file by the cheap pre-check.
CHECK_RECORDS = 5
CHECK_MAX_RECORDS = 10_000
HISTOGRAM_BINS = 20
PREVIEW_ROWS = 12
PREVIEW_CHARS = 300
BAD_LINE_SAMPLES = 20
_WRITE_SLICE = 1 << 16
BOM = codecs.BOM_UTF8
SKIP_HINT = "Fix the file, or set corpus.skip_bad_lines: true to skip such records (they are counted)."

# The output line format shards and read_split rely on: json.dumps({"text": t}, ensure_ascii=False).
_ENCODE_STR = json.JSONEncoder(ensure_ascii=False).encode
EMPTY_LINE = b'{"text": ""}\n'
_NON_SPACE = re.compile(r"[^ \t\r\n]")


class CorpusError(UserError, ValueError):
    """Bad prompt input; names the file (and line) and the fix."""


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record that cannot be used; ``message`` starts with file:line."""

    message: str


def clean(text: str) -> str:
    return unicodedata.normalize("NFC", text).strip()


def prompt_format(file: Path) -> str | None:
    """The prompt format of a file name (``.gz`` looked through), or None if unsupported."""
    name = file.name.lower()
    if name.endswith(GZIP_SUFFIX):
        name = name[: -len(GZIP_SUFFIX)]
    suffix = os.path.splitext(name)[1]
    return suffix if suffix in PROMPT_FORMATS else None


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a string"


def _field_problem(obj: object, text_field: str) -> str:
    """Why ``obj`` holds no string prompt under ``text_field`` (called only for bad records)."""
    if not isinstance(obj, dict):
        return f"expected an object with a string {text_field!r}, got {_json_kind(obj)}."
    if text_field not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:6]) or "no keys"
        return (f"key {text_field!r} is missing (the object has {keys}). Set the text field (corpus.text_field "
                "for local files, the dataset's text_field for datasets) to the key that holds the prompt.")
    return f"key {text_field!r} is {_json_kind(obj[text_field])}, not a string."


# -- reading ------------------------------------------------------------------------------

class _HashingRaw(io.RawIOBase):
    """Hashes the on-disk bytes as they are read, so a source is read once for text and hash."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
        return n


@contextlib.contextmanager
def _open_binary(file: Path) -> Iterator[tuple[BinaryIO, _HashingRaw]]:
    try:
        raw = open(file, "rb", buffering=0)  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        raise CorpusError(f"{file}: prompt file not found. Fix the path in corpus.local_prompt_files "
                          "(or the dataset source).") from None
    except OSError as exc:
        raise CorpusError(f"{file}: cannot be read ({exc.strerror or exc}). "
                          "Check that it is a readable file.") from None
    hashing = _HashingRaw(raw)
    stream: BinaryIO = io.BufferedReader(hashing, buffer_size=READ_CHUNK_BYTES)
    if file.name.lower().endswith(GZIP_SUFFIX):
        stream = gzip.GzipFile(fileobj=stream, mode="rb")
    try:
        yield stream, hashing
    finally:
        stream.close()
        raw.close()


def _where_bytes(gz: bool) -> str:
    return " of the decompressed data" if gz else ""


def _lines(stream: BinaryIO, file: Path, gz: bool) -> Iterator[tuple[int, str | BadRecord]]:
    """(line number, decoded line with its line end, or a BadRecord), one line in memory at a time.

    Lines are decoded one by one, so a non-UTF-8 byte is reported with its offset from the
    start of the file (of the decompressed data for .gz) and only its line is lost.
    """
    offset = 0
    line_no = 0
    while True:
        raw = stream.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return
        line_no += 1
        start = offset
        offset += len(raw)
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            while (rest := stream.readline(READ_CHUNK_BYTES)) and not rest.endswith(b"\n"):
                offset += len(rest)
            offset += len(rest)
            yield line_no, BadRecord(f"{file}:{line_no}: line longer than {MAX_RECORD_BYTES >> 20} MiB; "
                                     "a prompt file holds one prompt per line.")
            continue
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
            start += len(BOM)
        try:
            yield line_no, raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield line_no, BadRecord(f"{file}:{line_no}: not UTF-8 (bad byte at offset {start + exc.start}"
                                     f"{_where_bytes(gz)}). Re-save the file as UTF-8.")


def _read_txt(stream: BinaryIO, file: Path, text_field: str, gz: bool) -> Iterator[str | BadRecord]:
    for _, line in _lines(stream, file, gz):
        yield line.rstrip("\r\n") if type(line) is str else line


def _read_jsonl(stream: BinaryIO, file: Path, text_field: str, gz: bool) -> Iterator[str | BadRecord]:
    loads = json.loads
    for line_no, line in _lines(stream, file, gz):
        if type(line) is not str:
            yield line
            continue
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except json.JSONDecodeError as exc:
            yield BadRecord(f"{file}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno}). Each line must be "
                            f'an object like {{"{text_field}": "a prompt"}}.')
            continue
        if type(obj) is dict:
            value = obj.get(text_field)
            if type(value) is str:
                yield value
                continue
        yield BadRecord(f"{file}:{line_no}: {_field_problem(obj, text_field)}")


def _read_csv(stream: BinaryIO, file: Path, text_field: str, gz: bool) -> Iterator[str | BadRecord]:
    # A 1 MB prompt in one cell is legal; the default cap is 128 KiB. Raising a process-wide
    # cap only ever accepts more.
    csv.field_size_limit(max(csv.field_size_limit(), MAX_RECORD_BYTES))
    position = {"line": 0}
    undecodable: list[BadRecord] = []

    def decoded_lines() -> Iterator[str]:
        for line_no, line in _lines(stream, file, gz):
            position["line"] = line_no
            if type(line) is str:
                yield line
            else:
                undecodable.append(line)

    reader = csv.reader(decoded_lines())
    column = None
    while True:
        try:
            row: list[str] | BadRecord | None = next(reader)
        except StopIteration:
            row = None
        except csv.Error as exc:
            row = BadRecord(f"{file}:{position['line']}: not valid CSV ({exc}).")
        yield from undecodable
        undecodable.clear()
        if row is None:
            return
        if type(row) is BadRecord:
            yield row
        elif column is None:
            if not any(cell.strip() for cell in row):
                continue  # blank lines before the header
            if text_field not in row:
                raise CorpusError(f"{file}:{position['line']}: no column {text_field!r} in the header row "
                                  f"(columns: {', '.join(repr(c) for c in row[:12])}). Set corpus.text_field (or the "
                                  "dataset's text_field) to the column that holds the prompt.")
            column = row.index(text_field)
        elif len(row) > column:
            yield row[column]
        elif row:
            yield BadRecord(f"{file}:{position['line']}: the row has {len(row)} fields, but column {text_field!r} "
                            f"is field {column + 1}.")


class _DecodedChunks:
    """A binary stream decoded to text chunk by chunk; non-UTF-8 bytes name their file offset."""

    def __init__(self, stream: BinaryIO, file: Path, gz: bool) -> None:
        self._stream, self._file, self._gz = stream, file, gz
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._offset = 0
        self.eof = False

    def read(self, size: int) -> str:
        data = self._stream.read(size)
        if self._offset == 0 and data.startswith(BOM):
            data = data[len(BOM):]
            self._offset = len(BOM)
        self.eof = not data
        pending = len(self._decoder.getstate()[0])
        try:
            text = self._decoder.decode(data, final=self.eof)
        except UnicodeDecodeError as exc:
            # exc.start counts from the bytes held back from the previous chunk.
            raise CorpusError(f"{self._file}: not UTF-8 (bad byte at offset {self._offset - pending + exc.start}"
                              f"{_where_bytes(self._gz)}). Re-save the file as UTF-8.") from None
        self._offset += len(data)
        return text


def _read_json(stream: BinaryIO, file: Path, text_field: str, gz: bool) -> Iterator[str | BadRecord]:
    """Items of a top-level JSON list, parsed one at a time from a sliding window.

    A syntax error or a non-UTF-8 byte stops the file even with skip_bad_lines: after
    either, where the next item starts cannot be known.
    """
    chunks = _DecodedChunks(stream, file, gz)
    decoder = json.JSONDecoder()
    buf, pos, lines_before = "", 0, 0  # lines_before: newlines in the text already dropped from buf

    def line_at(p: int) -> int:
        return 1 + lines_before + buf.count("\n", 0, p)

    def more() -> bool:
        """Drop the consumed text and append at least as much as is still pending (doubling)."""
        nonlocal buf, pos, lines_before
        if chunks.eof:
            return False
        lines_before += buf.count("\n", 0, pos)
        buf = buf[pos:] + chunks.read(max(READ_CHUNK_BYTES, len(buf) - pos))
        pos = 0
        return True

    def skip_space() -> bool:
        nonlocal pos
        while True:
            match = _NON_SPACE.search(buf, pos)
            if match:
                pos = match.start()
                return True
            pos = len(buf)
            if not more():
                return False

    shape = f"A .json prompt file must hold a list of strings or of objects with a string {text_field!r}."
    if not skip_space():
        raise CorpusError(f"{file}: the file holds no prompts (it is empty or whitespace only). "
                          "Remove it from the sources or fill it.")
    if buf[pos] != "[":
        raise CorpusError(f"{file}:{line_at(pos)}: the file does not start with a list. {shape}")
    pos += 1
    index = 0
    while True:
        if not skip_space():
            raise CorpusError(f"{file}:{line_at(pos)}: not valid JSON (the list is not closed). {shape}")
        if buf[pos] == "]":
            pos += 1
            break
        if index:
            if buf[pos] != ",":
                raise CorpusError(f"{file}:{line_at(pos)}: not valid JSON (expected ',' or ']' after item "
                                  f"{index - 1}). {shape}")
            pos += 1
            if not skip_space():
                raise CorpusError(f"{file}:{line_at(pos)}: not valid JSON (the list is not closed). {shape}")
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if len(buf) - pos <= MAX_RECORD_BYTES and more():
                    continue
                raise CorpusError(f"{file}:{line_at(exc.pos)}: not valid JSON ({exc.msg}) in item {index}. "
                                  f"{shape}") from None
            # A value that ends exactly at the window's end may continue (a number split in two).
            if end == len(buf) and more():
                continue
            break
        if type(value) is str:
            yield value
        elif type(value) is dict and type(value.get(text_field)) is str:
            yield value[text_field]
        else:
            yield BadRecord(f"{file}:{line_at(pos)}: item {index}: {_field_problem(value, text_field)}")
        pos = end
        index += 1
    if skip_space():
        raise CorpusError(f"{file}:{line_at(pos)}: not valid JSON (text after the closing ']'). {shape}")


def _parquet_error(file: Path, exc: BaseException) -> CorpusError:
    return CorpusError(f"{file}: not a readable parquet file ({exc}). Re-export it, or convert it to .jsonl.")


def _read_parquet(file: Path, text_field: str) -> Iterator[str | BadRecord]:
    """The text column of a parquet file, a batch of rows at a time; rows are numbered from 1."""
    # Imported here: pyarrow takes a while to import, and only parquet sources need it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except FileNotFoundError:
        raise CorpusError(f"{file}: prompt file not found. Fix the path in corpus.local_prompt_files "
                          "(or the dataset source).") from None
    except (pa.ArrowException, OSError) as exc:
        raise _parquet_error(file, exc) from None
    with parquet:
        schema = parquet.schema_arrow
        if text_field not in schema.names:
            raise CorpusError(f"{file}: no column {text_field!r} (columns: "
                              f"{', '.join(repr(c) for c in schema.names[:12])}). Set corpus.text_field (or the "
                              "dataset's text_field) to the column that holds the prompt.")
        kind = schema.field(text_field).type
        value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)
                or pa.types.is_string_view(value_kind)):
            raise CorpusError(f"{file}: column {text_field!r} holds {kind}, not strings. Set corpus.text_field (or "
                              "the dataset's text_field) to the column that holds the prompt.")
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field],
                                              use_threads=False):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if type(value) is str:
                        yield value
                    else:
                        yield BadRecord(f"{file}: row {row}: column {text_field!r} is null, not a string.")
        except (pa.ArrowException, OSError) as exc:
            raise _parquet_error(file, exc) from None


_READERS: dict[str, Callable[[BinaryIO, Path, str, bool], Iterator[str | BadRecord]]] = {
    ".txt": _read_txt, ".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}


class _PromptFile:
    """One source file; ``records()`` streams it, after which ``sha256`` is its on-disk hash."""

    def __init__(self, file: Path, text_field: str) -> None:
        self.file = file
        self.text_field = text_field
        self.format = prompt_format(file)
        self.sha256: str | None = None
        if self.format is None:
            raise CorpusError(f"{file}: unsupported prompt file type. Use .txt (one prompt per line), .jsonl, .json "
                              f"or .csv, optionally gzip-compressed ({GZIP_SUFFIX}), or .parquet.")
        if self.format == PARQUET and file.name.lower().endswith(GZIP_SUFFIX):
            raise CorpusError(f"{file}: a gzip-compressed parquet file cannot be read in place. Decompress it; "
                              "parquet compresses its columns itself.")

    def records(self) -> Iterator[str | BadRecord]:
        if self.format == PARQUET:
            # pyarrow seeks to the footer first, so the file is hashed in a pass of its own.
            yield from _read_parquet(self.file, self.text_field)
            self.sha256 = atomic.sha256_file(self.file)
            return
        gz = self.file.name.lower().endswith(GZIP_SUFFIX)
        with _open_binary(self.file) as (stream, hashing):
            try:
                yield from _READERS[self.format](stream, self.file, self.text_field, gz)
            except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
                raise CorpusError(f"{self.file}: not a valid gzip file ({exc}). Re-compress it, or drop the "
                                  f"{GZIP_SUFFIX} suffix if it is not compressed.") from None
            except OSError as exc:
                raise CorpusError(f"{self.file}: cannot be read ({exc.strerror or exc}).") from None
            self.sha256 = hashing.sha256.hexdigest()


def read_prompt_file(file: Path, *, text_field: str = "text", skip_bad_lines: bool = False) -> Iterator[str]:
    """The raw prompts of one file; a bad record raises CorpusError unless skip_bad_lines."""
    for value in _PromptFile(file, text_field).records():
        if type(value) is str:
            yield value
        elif not skip_bad_lines:
            raise CorpusError(f"{value.message} {SKIP_HINT}")


def _check_file(file: Path, *, text_field: str, skip_bad_lines: bool, setting: str) -> None:
    """Cheap check: exists, readable, non-empty, and its first records parse."""
    if not file.exists():
        raise CorpusError(f"{file}: prompt file not found. Fix the path in {setting}.")
    if not file.is_file():
        raise CorpusError(f"{file}: is not a file. Fix the path in {setting}.")
    source = _PromptFile(file, text_field)
    if file.stat().st_size == 0:
        raise CorpusError(f"{file}: the file is empty; it holds no prompts. Remove it from {setting} or fill it.")
    found_prompt = False
    records = source.records()
    try:
        for n, value in enumerate(records, 1):
            if type(value) is not str:
                if not skip_bad_lines:
                    raise CorpusError(f"{value.message} {SKIP_HINT}")
            elif not found_prompt and value.strip():
                found_prompt = True
            if (found_prompt and n >= CHECK_RECORDS) or n >= CHECK_MAX_RECORDS:
                return
    finally:
        records.close()
    if not found_prompt:
        raise CorpusError(f"{file}: the file holds no prompts (it is empty or whitespace only). "
                          f"Remove it from {setting} or fill it.")


def check_prompt_files(paths: ProjectPaths, settings: Settings) -> list[Path]:
    """Check ``corpus.local_prompt_files`` cheaply, before any expensive work; return them.

    Each must exist, be readable and non-empty, and its first records must parse. This
    reads only the start of each file, so it is safe to call before launching a pipeline.
    """
    c = settings.corpus
    files = [paths.resolve_local(value) for value in c.local_prompt_files]
    for file in files:
        _check_file(file, text_field=c.text_field, skip_bad_lines=c.skip_bad_lines,
                    setting="corpus.local_prompt_files")
    return files


def _dataset_files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    files = sorted(p for p in folder.rglob("*") if p.is_file() and prompt_format(p)
                   and not p.name.startswith(atomic.TEMP_PREFIX) and p.name not in DATASET_METADATA_FILES)
    if not files:
        raise CorpusError(f"{folder}: no prompt files ({', '.join(PROMPT_FORMATS)}, the text formats optionally "
                          f"{GZIP_SUFFIX}) in this dataset folder.")
    return files


def iter_sources(paths: ProjectPaths, settings: Settings, materials: dict) -> Iterator[tuple[str, Path, str]]:
    """(source label, file, text_field) for every prompt file, in a fixed order."""
    for ds in materials.get("datasets", []):
        for file in _dataset_files(Path(ds["path"])):
            yield ds["source"], file, ds.get("text_field") or "text"
    for value in settings.corpus.local_prompt_files:
        yield value, paths.resolve_local(value), settings.corpus.text_field


# -- building -----------------------------------------------------------------------------

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
        source = _PromptFile(file, text_field)
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
            text = normalize("NFC", value).strip()
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


def build_corpus(paths: ProjectPaths, settings: Settings, materials: dict, *, fingerprint: str) -> dict:
    """Write corpus/train.jsonl, corpus/val.jsonl and corpus/manifest.json; return the manifest."""
    c = settings.corpus
    sources = list(iter_sources(paths, settings, materials))
    for label, file, text_field in sources:  # cheap checks of every file before any full read
        setting = "corpus.local_prompt_files" if label in c.local_prompt_files else f"the dataset {label!r}"
        _check_file(file, text_field=text_field, skip_bad_lines=c.skip_bad_lines, setting=setting)

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
    manifest = {
        "fingerprint": fingerprint,
        "settings": settings.section_dict("corpus"),
        "counts": counts,
        "per_source": dict(per_source),
        "sources": [{**asdict(st), "file": paths.stored(st.file)} for st in stats],
        "bad_line_samples": pool.bad_samples,
        "length_histogram": _length_histogram(kept_chars),
        "length_chars": ({"min": int(kept_chars.min()), "median": int(np.median(kept_chars)),
                          "mean": round(float(kept_chars.mean()), 1), "max": int(kept_chars.max())}
                         if n_kept else {}),
        "requested": need,
        "preview": preview,
        "splits": split_meta,
    }
    atomic.write_json(paths.corpus_manifest, manifest)
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
    with atomic.atomic_path(final) as tmp, open(tmp, "wb", buffering=READ_CHUNK_BYTES) as out:
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
