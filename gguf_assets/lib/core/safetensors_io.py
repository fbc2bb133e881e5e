"""The one safetensors reader: header checks, a memory-mapped numpy view, and a fast torch read.

Format: u64 little-endian header length N, N bytes of JSON header
``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data;
offsets are relative to the first data byte.

- ``SafetensorsFile`` (numpy, memory-mapped): the GGUF evaluation, the vision export and the
  materials checks. No torch: the evaluation stays independent of the training code.
- ``read_torch``: training's reader. It reads the whole file front to back in large chunks
  (what keeps a spinning or network disk near its streaming rate) and checks the content
  against a recorded sha256 as the bytes arrive. torch is imported only inside it.

Every file's header is checked the same way (``parse_header``, through ``check_layout``, which the query rows'
ranged reader shares): a header that does not fit the file, or a tensor whose offsets do not fit its shape or the
file, or overlap another tensor's bytes, is named with the path, as safetensors itself refuses such a file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gguf_assets.lib.core import verify

# Stored dtype per safetensors tag; BF16 is read as raw uint16 and widened by to_float32.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
# Bits per element of every safetensors dtype (safetensors' Dtype::bitsize): a checkpoint may hold fp8 or fp4
# tensors beside what this project reads, and their bytes must be sized all the same.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
    "I64": 64, "U64": 64,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
READ_CHUNK_BYTES = 32 << 20


def to_float32(raw: np.ndarray, st_dtype: str) -> np.ndarray:
    """float32 copy of a raw safetensors array (bf16: its bits are the top half of an f32)."""
    if st_dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(raw, dtype=np.float32).copy()


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_layout(where: Path | str, entries: dict[str, Any], data_start: int, file_size: int | None) -> None:
    """Check a safetensors header's tensor entries (``__metadata__`` taken out) as safetensors does, before any
    tensor is read: each entry a {dtype, shape, data_offsets} of a known dtype, its bytes exactly dtype x shape,
    and the tensors, in offset order, covering the file's bytes from ``data_start`` (8 + the header's length)
    contiguously: no overlap (a tensor read from another's bytes), no gap, nothing past the file and nothing after
    the last tensor. ``file_size`` None (not known) checks all but the end. Raises ValueError naming ``where`` and
    the tensor."""
    spans = []
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise ValueError(f"{where}: tensor {name!r} has an unreadable header entry {_cut(entry)} (it needs "
                             "dtype, shape and data_offsets)")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BITS:
            raise ValueError(f"{where}: tensor {name!r} has unknown dtype {_cut(dtype)} (safetensors' dtypes: "
                             f"{', '.join(DTYPE_BITS)})")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {_cut(shape)}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
                or offsets[0] > offsets[1]:
            raise ValueError(f"{where}: tensor {name!r} has data_offsets {_cut(offsets)}, not [begin, end] with "
                             "0 <= begin <= end")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise ValueError(f"{where}: tensor {name!r} data_offsets {offsets} do not fit its shape {shape} and "
                             f"dtype {dtype} ({bits / 8:g} bytes)")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end, last = 0, None
    for begin, stop, name in spans:
        if begin < end:
            raise ValueError(f"{where}: tensor {name!r} data_offsets [{begin}, {stop}] overlap tensor {last[2]!r}'s "
                             f"[{last[0]}, {last[1]}]: it would be read from another tensor's bytes (safetensors "
                             "refuses such a file: it is damaged or was not written by a safetensors writer)")
        if begin > end:
            raise ValueError(f"{where}: tensor {name!r} data_offsets [{begin}, {stop}] leave bytes {end} to {begin} "
                             "of no tensor before it (safetensors refuses such a file, its tensors must cover the data "
                             "contiguously: it is damaged or was not written by a safetensors writer)")
        end, last = stop, (begin, stop, name)
    if file_size is not None and data_start + end > file_size:
        raise ValueError(f"{where}: truncated: its tensors need {data_start + end} bytes, the file has {file_size} "
                         f"(tensor {last[2]!r} ends past it)")
    if file_size is not None and data_start + end < file_size:
        after = f"the last tensor ({last[2]!r})" if last else "a header that names no tensor"
        raise ValueError(f"{where}: {file_size - data_start - end} bytes follow {after} (safetensors refuses such "
                         "a file: it is damaged, or something was appended to it)")


def parse_header(path: Path, prefix: bytes, read, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor entries, __metadata__, first data byte) from the 8-byte ``prefix``; ``read(n)`` reads on.

    Raises ValueError, naming ``path``, when the header or a tensor's offsets do not fit the file
    (a truncated download or copy) or each other (``check_layout``), or a dtype is not one this reader reads.
    """
    if len(prefix) != 8:
        raise ValueError(f"{path}: too short for a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes)")
    try:
        header = json.loads(read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    check_layout(path, header, 8 + n, size)
    for name, entry in header.items():
        if entry["dtype"] not in NUMPY_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']!r} "
                             f"(supported: {sorted(NUMPY_DTYPES)})")
    return header, metadata, 8 + n


def safetensors_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header with __metadata__, first data byte, file size); reads and checks the header only."""
    size = Path(path).stat().st_size
    with open(path, "rb") as fh:
        header, metadata, start = parse_header(Path(path), fh.read(8), fh.read, size)
    return {**header, "__metadata__": metadata}, start, size


class SafetensorsFile:
    """Read-only, memory-mapped numpy view of one .safetensors file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            self._entries, self.metadata, self._start = parse_header(self.path, fh.read(8), fh.read, size)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag ("F32", "BF16", ...)."""
        return self._entry(name)["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy memmap view in the stored dtype (BF16 as uint16)."""
        entry = self._entry(name)
        begin, end = entry["data_offsets"]
        data = self._mm[self._start + begin:self._start + end]
        return data.view(NUMPY_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as an in-memory array; BF16 becomes float32, other dtypes are kept."""
        if self.dtype(name) == "BF16":
            return to_float32(self.raw(name), "BF16")
        return np.array(self.raw(name))

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r} (has {sorted(self._entries)})")
        return self._entries[name]


def read_numpy(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as numpy (BF16 widened to float32)."""
    st = SafetensorsFile(path)
    return {name: st.get(name) for name in st.keys()}


@dataclass
class ReadStats:
    bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


_MMAP_OPTIONS = ({"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)}
                 if hasattr(mmap, "MAP_ANONYMOUS") else {})


def read_torch(path: Path, *, stats: ReadStats | None = None, chunk_bytes: int = READ_CHUNK_BYTES,
               expected_sha256: str | None = None) -> dict:
    """Every tensor of a .safetensors file as torch tensors over one buffer, read in large chunks.

    Unlike safetensors' mmap loader, the page faults of which read in small steps, this issues a
    few large reads (and tells the kernel the access is sequential). With ``expected_sha256`` the
    bytes are hashed as they arrive and verify.CorruptFile is raised on a difference; a file
    shorter than its header says raises ValueError.
    """
    import torch

    start = time.perf_counter()
    check = verify.ContentCheck(path, expected_sha256)
    with open(path, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        seen = []  # the header's bytes, for the content check

        def read(n: int) -> bytes:
            seen.append(fh.read(n))
            return seen[-1]

        header, _, data_start = parse_header(Path(path), read(8), read, os.fstat(fh.fileno()).st_size)
        for part in seen:
            check.update(part)
        data_len = max((v["data_offsets"][1] for v in header.values()), default=0)
        # Straight from the kernel: freeing a shard unmaps it, where malloc'd buffers of shard size would
        # fragment the heap and let RSS creep up with the number of shards streamed. Populating the
        # mapping up front costs one call instead of a page fault per 4 KiB read into it.
        mapping = mmap.mmap(-1, max(1, data_len), **_MMAP_OPTIONS)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)[:data_len]
        view = memoryview(mapping)
        done = 0
        while done < data_len:
            got = fh.readinto(view[done:done + chunk_bytes])
            if not got:
                raise ValueError(f"{path}: truncated ({done} of {data_len} data bytes)")
            check.update(view[done:done + got])
            done += got
        check.update(fh.read())  # nothing, in a well-formed file; anything appended counts as a change
    check.finish()
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _torch_dtype(info["dtype"])
        raw = buffer[begin:end]
        if begin % dtype.itemsize:  # views need aligned storage offsets
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(info["shape"])
    if stats is not None:
        stats.bytes += data_start + data_len
        stats.seconds += time.perf_counter() - start
    return tensors


def _torch_dtype(tag: str):
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}[tag]
