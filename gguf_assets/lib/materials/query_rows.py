"""Query rows as a material of their own (``materials.query_rows``).

A stock LLM repo holds no query rows: they ship inside the text-to-image checkpoint, in another repo,
inside a big safetensors file under a model-specific name. This fetches only that one tensor:

1. the file's header, by HTTP range on the hub (8-byte little-endian length, then the JSON header);
2. the named tensor's bytes, by one more range (resumed from a partial file after a kill);
3. checks: a float dtype, size = dtype x shape, 2-D with the teacher's hidden size as width, finite values;
4. ``materials/query_rows.safetensors``, written atomically, holding that tensor alone (as ``query_rows``).

The manifest entry records the source, the commit the hub resolved (or a local file's sha256), the file's
etag and size from the hub's metadata, and the tensor's sha256; a rerun with the same setting reuses the
stored file after a stamp check, and a changed setting fetches again.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.safetensors_io import MAX_HEADER_BYTES, check_layout, to_float32

ROWS_FILE = "query_rows.safetensors"
STORED_TENSOR = "query_rows"  # the name the rows have in the stored file
PARTIAL_DIR = ".query_rows_download"  # under materials/: the header and the tensor's bytes while they arrive
SETTING = "materials.query_rows"
ROW_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# Bytes per element of every safetensors dtype (a big checkpoint may hold fp8 or int tensors beside the rows).
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
              "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


class QueryRowsError(UserError, RuntimeError):
    """Query rows that cannot be used; the message names the setting and the fix."""


# ---------------------------------------------------------------- header and ranges (no I/O)

def header_length(prefix: bytes, *, file_size: int | None = None, where: str = "the file") -> int:
    """The JSON header's length from a safetensors file's first 8 bytes (u64 little-endian)."""
    if len(prefix) != 8:
        raise QueryRowsError(f"{where}: too short for a safetensors file ({len(prefix)} bytes)")
    (n,) = struct.unpack("<Q", prefix)
    limit = MAX_HEADER_BYTES if file_size is None else min(MAX_HEADER_BYTES, file_size - 8)
    if n < 2 or n > limit:
        raise QueryRowsError(f"{where}: not a safetensors file (header length {n}"
                             + (f", file size {file_size}" if file_size is not None else "") + ")")
    return n


def parse_header(raw: bytes, *, where: str = "the file", file_size: int | None = None,
                 tensor: str | None = None) -> dict[str, dict]:
    """The tensor entries of a safetensors JSON header (``__metadata__`` dropped), checked as safetensors checks
    them (safetensors_io.check_layout: every tensor's bytes its own, dtype x shape, within the file of
    ``file_size`` bytes), so rows are never taken from another tensor's bytes."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QueryRowsError(f"{where}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise QueryRowsError(f"{where}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    try:
        check_layout(where, header, 8 + len(raw), file_size)
    except ValueError as exc:
        # The tensor asked for first (the header's first problem may be another tensor's), then that problem.
        asked = f".tensor = {tensor!r}: {where} cannot be read safely, its header does not hold together: " \
            if tensor else ": "
        raise QueryRowsError(f"{SETTING}{asked}{str(exc).rstrip('.')}. Nothing was stored: point {SETTING} at an "
                             "intact safetensors file.") from None
    return header


def tensor_span(entries: dict[str, dict], name: str, header_len: int, *, file_size: int | None = None,
                where: str = "the file") -> tuple[int, int]:
    """[start, end) of tensor ``name`` in the file; its size must be dtype x shape and fit the file."""
    entry = entries[name]
    dtype, shape = entry.get("dtype"), entry.get("shape")
    begin, end = entry.get("data_offsets", (None, None))
    if dtype not in ITEM_BYTES or not isinstance(shape, list) or not isinstance(begin, int) \
            or not isinstance(end, int):
        raise QueryRowsError(f"{where}: tensor {name!r} has an unreadable header entry {entry}")
    if not 0 <= begin <= end or end - begin != math.prod(shape) * ITEM_BYTES[dtype]:
        raise QueryRowsError(f"{where}: tensor {name!r} data_offsets {[begin, end]} do not fit its shape {shape} "
                             f"and dtype {dtype} ({math.prod(shape) * ITEM_BYTES[dtype]} bytes)")
    start = 8 + header_len
    if file_size is not None and start + end > file_size:
        raise QueryRowsError(f"{where}: tensor {name!r} ends at byte {start + end}, past the file ({file_size} bytes)")
    return start + begin, start + end


def candidates(entries: dict[str, dict], hidden: int) -> list[tuple[str, list[int]]]:
    """The 2-D tensors whose width is the teacher's hidden size: what the rows could be."""
    return sorted((name, e["shape"]) for name, e in entries.items()
                  if isinstance(e.get("shape"), list) and len(e["shape"]) == 2 and e["shape"][1] == hidden)


def _listing(found: list[tuple[str, list[int]]]) -> str:
    return "\n".join(f"  {name}  {shape}" for name, shape in found) or "  (none)"


def check_choice(entries: dict[str, dict], tensor: str, hidden: int, where: str) -> dict:
    """The named tensor's entry, or a QueryRowsError listing the tensors that would fit."""
    entry = entries.get(tensor)
    shape = entry.get("shape") if entry else None
    if entry is None or not isinstance(shape, list) or len(shape) != 2 or shape[1] != hidden or shape[0] < 1:
        problem = "is not in" if entry is None else f"has shape {shape}, not Q x {hidden}, in"
        raise QueryRowsError(f"{SETTING}.tensor = {tensor!r} {problem} {where}; the query rows must be a 2-D "
                             f"tensor as wide as the teacher's hidden size ({hidden}). Its 2-D tensors of width "
                             f"{hidden}:\n{_listing(candidates(entries, hidden))}")
    if entry.get("dtype") not in ROW_DTYPES:
        raise QueryRowsError(f"{SETTING}.tensor = {tensor!r} in {where} has dtype {entry.get('dtype')}; the query "
                             f"rows must be floats ({', '.join(ROW_DTYPES)}).")
    return entry


def rows_array(data: bytes, entry: dict, where: str) -> np.ndarray:
    """The rows as float32, checked: exactly dtype x shape bytes, every value finite."""
    dtype, shape = entry["dtype"], entry["shape"]
    expected = math.prod(shape) * ROW_DTYPES[dtype].itemsize
    if len(data) != expected:
        raise QueryRowsError(f"{where}: got {len(data)} bytes for the query rows, expected {expected} "
                             f"({dtype} x {shape}); run again to fetch them anew.")
    rows = to_float32(np.frombuffer(data, dtype=ROW_DTYPES[dtype]).reshape(shape), dtype)
    if not np.isfinite(rows).all():
        raise QueryRowsError(f"{where}: the query rows hold {int((~np.isfinite(rows)).sum())} non-finite values "
                             "(nan or inf); they cannot be used. Check the tensor name.")
    return rows


def stored_bytes(data: bytes, entry: dict, metadata: dict[str, str]) -> bytes:
    """A safetensors file holding the rows alone, as ``query_rows``, in their own dtype."""
    header = {"__metadata__": metadata,
              STORED_TENSOR: {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [0, len(data)]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw + data


# ---------------------------------------------------------------- resolving

def setting_key(qr: dict) -> str:
    return atomic.fingerprint({k: qr.get(k, "") for k in ("source", "file", "tensor")})


def teacher_hidden_size(teacher_folder: Path) -> int:
    """The teacher's hidden size, as the teacher loader reads it (config.json, or its text_config)."""
    config = json.loads((Path(teacher_folder) / "config.json").read_text(encoding="utf-8"))
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    if not isinstance(hidden, int):
        raise QueryRowsError(f"{teacher_folder}/config.json names no hidden_size; the query rows' width cannot be "
                             "checked against the teacher.")
    return hidden


def reusable(entry: dict | None, qr: dict, hidden: int, stored: Path) -> dict | None:
    """The manifest entry again (its stamp refreshed) if the stored rows still answer this setting."""
    if not entry or entry.get("key") != setting_key(qr) or not stored.is_file():
        return None
    if entry.get("shape", [None, None])[1] != hidden:
        return None
    now = verify.confirmed(stored, entry.get("stored") or {})
    return None if now is None else {**entry, "stored": now}


def _finish(stored: Path, data: bytes, entry: dict, hidden: int, where: str, record: dict) -> dict:
    rows_array(data, entry, where)
    digest = hashlib.sha256(data).hexdigest()
    metadata = {"source": record["source"], "file": record["file"], "tensor": record["tensor"],
                "commit": record["commit"], "tensor_sha256": digest}
    atomic.write_bytes(stored, stored_bytes(data, entry, metadata))
    return {**record, "shape": list(entry["shape"]), "dtype": entry["dtype"], "tensor_sha256": digest,
            "path": str(stored), "stored": verify.record(stored)}


def resolve_local(qr: dict, local: Path, stored: Path, hidden: int, old: dict | None) -> dict:
    """Rows from a local safetensors file, or from ``file`` inside a local folder."""
    if local.is_dir():
        if not qr.get("file"):
            raise QueryRowsError(f"{SETTING}.source = {qr['source']!r} is a folder: set {SETTING}.file to the "
                                 "safetensors file in it that holds the rows.")
        path = local / qr["file"]
    else:
        if qr.get("file"):
            raise QueryRowsError(f"{SETTING}.source = {qr['source']!r} is a file; leave {SETTING}.file empty or "
                                 "point source at the folder that holds it.")
        path = local
    if not path.is_file():
        raise QueryRowsError(f"{SETTING}: {path} does not exist; point source (and file) at a safetensors file.")
    where = str(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        n = header_length(fh.read(8), file_size=size, where=where)
        entries = parse_header(fh.read(n), where=where, file_size=size, tensor=qr["tensor"])
        entry = check_choice(entries, qr["tensor"], hidden, where)
        start, end = tensor_span(entries, qr["tensor"], n, file_size=size, where=where)
        fh.seek(start)
        data = fh.read(end - start)
    source_record = (old or {}).get("source_file") or {}
    source_record = verify.confirmed(path, source_record) or verify.record(path)
    record = {"key": setting_key(qr), **{k: qr.get(k, "") for k in ("source", "file", "tensor")}, "origin": "local",
              "commit": "local:" + source_record["sha256"], "file_size": size, "source_file": source_record,
              "fetched_bytes": 0}
    return _finish(stored, data, entry, hidden, where, record)


def resolve_hub(qr: dict, materials_dir: Path, stored: Path, hidden: int, *, pinned: str | None,
                token: str | None, options) -> dict:
    """Rows from ``file`` of a hub repo at the pinned commit: header and tensor by HTTP range only."""
    from gguf_assets.lib.materials import hub

    if not qr.get("file"):
        raise QueryRowsError(f"{SETTING}.source = {qr['source']!r} is a hub repo: set {SETTING}.file to the "
                             "safetensors file in it that holds the rows (e.g. transformer/model.safetensors).")
    ref = hub.RepoRef.parse(qr["source"], kind="model")
    listing = hub.list_repo(ref, revision=pinned, token=token, options=options)
    remote = listing.files.get(qr["file"])
    if remote is None:
        files = sorted(p for p in listing.files if p.endswith(".safetensors"))
        raise QueryRowsError(f"{SETTING}.file = {qr['file']!r} is not in {ref} at {listing.commit[:12]}. Its "
                             f"safetensors files: {', '.join(files[:20]) or 'none'}.")
    where = f"{ref}:{qr['file']} at {listing.commit[:12]}"
    work = materials_dir / PARTIAL_DIR
    tag = f"{listing.commit[:12]}-{remote.etag[:16]}"
    fetched = 0

    def fetch(start: int, end: int, name: str) -> bytes:
        nonlocal fetched
        out = work / f"{tag}.{name}"
        before = out.stat().st_size if out.is_file() else 0
        meta = hub.fetch_range(ref, listing.commit, qr["file"], start, end, out, token=token, options=options)
        if meta.commit and meta.commit != listing.commit:
            raise QueryRowsError(f"{where}: the hub resolved the file at commit {meta.commit}, not the pinned "
                                 f"{listing.commit}; run again.")
        if (meta.etag or "").strip('"') not in ("", remote.etag):
            raise QueryRowsError(f"{where}: the hub's etag {meta.etag} is not the listed {remote.etag}; run again.")
        fetched += out.stat().st_size - before
        return out.read_bytes()

    try:
        n = header_length(fetch(0, 8, "prefix"), file_size=remote.size, where=where)
        entries = parse_header(fetch(8, 8 + n, "header"), where=where, file_size=remote.size, tensor=qr["tensor"])
        entry = check_choice(entries, qr["tensor"], hidden, where)
        start, end = tensor_span(entries, qr["tensor"], n, file_size=remote.size, where=where)
        data = fetch(start, end, f"{start}-{end}")
    except QueryRowsError:  # the user's to fix: nothing to resume (a cut connection keeps its partial bytes)
        shutil.rmtree(work, ignore_errors=True)
        raise
    record = {"key": setting_key(qr), **{k: qr.get(k, "") for k in ("source", "file", "tensor")}, "origin": "hub",
              "commit": listing.commit, "file_etag": remote.etag, "file_sha256": remote.sha256,
              "file_size": remote.size, "fetched_bytes": fetched}
    result = _finish(stored, data, entry, hidden, where, record)
    shutil.rmtree(work, ignore_errors=True)
    return result


def resolve(qr: dict, materials_dir: Path, local: Path, teacher_folder: Path, old: dict | None, *,
            is_repo: bool, token: str | None, options) -> dict:
    """The manifest entry of ``materials.query_rows``: reused when still current, else fetched and stored."""
    hidden = teacher_hidden_size(teacher_folder)
    stored = materials_dir / ROWS_FILE
    again = reusable(old, qr, hidden, stored)
    if again is not None and (again["origin"] == "hub"
                              or verify.confirmed(local if local.is_file() else local / qr.get("file", ""),
                                                  again.get("source_file") or {}) is not None):
        return again
    if local.exists():
        return resolve_local(qr, local, stored, hidden, old)
    if not is_repo:
        raise QueryRowsError(f"{SETTING}.source = {qr['source']!r}: no such file or folder ({local}) and not a hub "
                             "repo id (owner/name, optionally @revision).")
    pinned = old.get("commit") if old and old.get("source") == qr["source"] and old.get("origin") == "hub" else None
    return resolve_hub(qr, materials_dir, stored, hidden, pinned=pinned, token=token, options=options)


def rows_location(settings, materials_manifest, teacher_folder: Path) -> tuple[Path, str, str]:
    """(file, tensor, the setting to name in errors) of the query rows the teacher uses."""
    m = settings.materials
    entry = getattr(materials_manifest, "query_rows", None) if materials_manifest is not None else None
    if m.query_rows:
        if not entry or entry.get("key") != setting_key(m.query_rows):
            raise QueryRowsError(f"{SETTING} is set but materials/{ROWS_FILE} is not fetched for it yet: "
                                 "materialize the materials asset first.")
        return Path(entry["path"]), STORED_TENSOR, SETTING
    return Path(teacher_folder) / m.query_rows_file, m.query_rows_tensor, "materials.query_rows_file"


def describe(entry: dict[str, Any]) -> str:
    return (f"{entry['source']}:{entry.get('file') or ''}:{entry['tensor']} {entry['dtype']} {entry['shape']} at "
            f"{entry['commit'][:12]} ({entry.get('fetched_bytes', 0)} bytes fetched)")
