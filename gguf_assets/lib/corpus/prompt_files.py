"""Prompt files: read one source file as a stream of prompts, with file:line for every bad record.

``.txt`` (one prompt per line), ``.jsonl`` (an object per line), ``.json`` (a list of strings
or objects, parsed as a stream) and ``.csv`` (a header row naming the column), each optionally
gzip-compressed (``.gz`` after the suffix), and ``.parquet`` (a string column; compressed inside
the format). A UTF-8 BOM and CRLF line ends are accepted. Each file is hashed while it is read.
Building the corpus from these streams is lib/corpus/corpus.py.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.project.formats import GZIP_SUFFIX, PARQUET, PROMPT_FORMATS, TEXT_PROMPT_FORMATS
from gguf_assets.lib.project.layout import DATASET_METADATA_FILES, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings

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
BOM = codecs.BOM_UTF8
SKIP_HINT = "Fix the file, or set corpus.skip_bad_lines: true to skip such records (they are counted)."

_NON_SPACE = re.compile(r"[^ \t\r\n]")


class CorpusError(UserError, ValueError):
    """Bad prompt input; names the file (and line) and the fix."""


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record that cannot be used; ``message`` starts with file:line."""

    message: str


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
                # Only a \u escape can make a string that is not Unicode text (a lone surrogate).
                yield value if "\\u" not in line else _unicode_or_bad(value, f"{file}:{line_no}")
                continue
        yield BadRecord(f"{file}:{line_no}: {_field_problem(obj, text_field)}")


def _unicode_or_bad(text: str, where: str) -> str | BadRecord:
    """``text``, or a bad record when it holds a lone surrogate (a \\ud800-style escape with no pair), which no
    file can store as UTF-8 and no tokenizer reads."""
    problem = _surrogate_problem(text)
    return text if problem is None else BadRecord(f"{where}: {problem}")


def _surrogate_problem(text: str) -> str | None:
    """Why ``text`` is not Unicode text (it holds a lone surrogate), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"the prompt holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), "
                "which is not Unicode text: an escape like \\ud800 without its pair. Fix or drop the line.")
    return None


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


def _count_newlines(text: str, start: int, end: int) -> int:
    return text.count("\n", start, end)


def _read_json(stream: BinaryIO, file: Path, text_field: str, gz: bool) -> Iterator[str | BadRecord]:
    """Items of a top-level JSON list, parsed one at a time from a sliding window.

    A syntax error or a non-UTF-8 byte stops the file even with skip_bad_lines: after
    either, where the next item starts cannot be known.
    """
    chunks = _DecodedChunks(stream, file, gz)
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    # buf[line_pos] is on line line_no. Line numbers are wanted only for bad records and window moves, and
    # positions only grow, so each call counts the newlines since the last one: the whole file is counted
    # once, however many bad records it holds (recounting from the window's start for every item made
    # reading a .json list about 150 times slower than the same prompts as .jsonl).
    line_no, line_pos = 1, 0

    def line_at(p: int) -> int:
        nonlocal line_no, line_pos
        if p < line_pos:  # not reached (positions only grow), but right if it were
            return line_no - _count_newlines(buf, p, line_pos)
        line_no += _count_newlines(buf, line_pos, p)
        line_pos = p
        return line_no

    def more() -> bool:
        """Drop the consumed text and append at least as much as is still pending (doubling)."""
        nonlocal buf, pos, line_pos
        if chunks.eof:
            return False
        line_at(pos)
        buf = buf[pos:] + chunks.read(max(READ_CHUNK_BYTES, len(buf) - pos))
        pos = line_pos = 0
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
        prompt = value if type(value) is str else value.get(text_field) if type(value) is dict else None
        if type(prompt) is str:
            # Only a \u escape can make a string that is not Unicode text (a lone surrogate).
            problem = _surrogate_problem(prompt) if buf.find("\\u", pos, end) >= 0 else None
        else:
            problem = _field_problem(value, text_field)
        yield prompt if problem is None else BadRecord(f"{file}:{line_at(pos)}: item {index}: {problem}")
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


# A reader for each text format (lib/project/formats.py: TEXT_PROMPT_FORMATS); parquet is read by _read_parquet.
_READERS: dict[str, Callable[[BinaryIO, Path, str, bool], Iterator[str | BadRecord]]] = {
    ".txt": _read_txt, ".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}


class PromptFile:
    """One source file; ``records()`` streams it, after which ``sha256`` is its on-disk hash."""

    def __init__(self, file: Path, text_field: str) -> None:
        self.file = file
        self.text_field = text_field
        self.format = prompt_format(file)
        self.sha256: str | None = None
        if self.format is None:
            first, *others, last = TEXT_PROMPT_FORMATS
            raise CorpusError(f"{file}: unsupported prompt file type. Use {first} (one prompt per line), "
                              f"{', '.join(others)} or {last}, optionally gzip-compressed ({GZIP_SUFFIX}), or "
                              f"{PARQUET}.")
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
    for value in PromptFile(file, text_field).records():
        if type(value) is str:
            yield value
        elif not skip_bad_lines:
            raise CorpusError(f"{value.message} {SKIP_HINT}")


def check_file(file: Path, *, text_field: str, skip_bad_lines: bool, setting: str) -> None:
    """Cheap check: exists, readable, non-empty, and its first records parse."""
    if not file.exists():
        raise CorpusError(f"{file}: prompt file not found. Fix the path in {setting}.")
    if not file.is_file():
        raise CorpusError(f"{file}: is not a file. Fix the path in {setting}.")
    source = PromptFile(file, text_field)
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
        check_file(file, text_field=c.text_field, skip_bad_lines=c.skip_bad_lines,
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


def iter_sources(paths: ProjectPaths, settings: Settings,
                 materials: MaterialsManifest) -> Iterator[tuple[str, Path, str]]:
    """(source label, file, text_field) for every prompt file, in a fixed order."""
    for ds in materials.datasets:
        for file in _dataset_files(Path(ds["path"])):
            yield ds["source"], file, ds.get("text_field") or "text"
    for value in settings.corpus.local_prompt_files:
        yield value, paths.resolve_local(value), settings.corpus.text_field
