"""The project's safetensors reader checks a header's layout as safetensors itself does (safetensors_io.check_layout):
every tensor's bytes its own, exactly dtype x shape, the data covered contiguously and within the file. A file
safetensors refuses is refused here too, naming the file and the tensor, before any tensor is read."""

import json
import struct

import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from gguf_assets.lib.core import safetensors_io


def _file(entries: dict, data: bytes) -> bytes:
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


F32_2x2 = {"dtype": "F32", "shape": [2, 2]}


@pytest.mark.parametrize(("entries", "data_len", "said"), [
    # The issue's file: `rows` points into `a`'s bytes (safetensors: InvalidOffset).
    ({"a": {**F32_2x2, "data_offsets": [0, 16]}, "rows": {**F32_2x2, "data_offsets": [8, 24]}}, 24,
     "tensor 'rows' data_offsets [8, 24] overlap tensor 'a''s [0, 16]: it would be read from another tensor's bytes"),
    ({"a": {**F32_2x2, "data_offsets": [0, 16]}, "rows": {**F32_2x2, "data_offsets": [0, 16]}}, 16,
     "overlap tensor 'a''s [0, 16]"),
    ({"a": {**F32_2x2, "data_offsets": [0, 16]}, "rows": {**F32_2x2, "data_offsets": [24, 40]}}, 40,
     "tensor 'rows' data_offsets [24, 40] leave bytes 16 to 24 of no tensor before it"),
    ({"a": {**F32_2x2, "data_offsets": [0, 16]}, "rows": {**F32_2x2, "data_offsets": [16, 32]}}, 24,
     "bytes, the file has"),  # and "truncated: its tensors need", checked below
    ({"a": {**F32_2x2, "data_offsets": [0, 16]}}, 24, "8 bytes follow the last tensor ('a')"),
    ({"a": {**F32_2x2, "data_offsets": [0, 12]}}, 12, "tensor 'a' data_offsets [0, 12] do not fit its shape [2, 2]"),
    ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, 4, "tensor 'a' has unknown dtype 'F33'"),
    ({"a": {**F32_2x2, "data_offsets": [16, 0]}}, 16, "tensor 'a' has data_offsets [16, 0], not [begin, end]"),
    ({"a": [0, 16]}, 16, "tensor 'a' has an unreadable header entry [0, 16]"),
])
def test_a_header_safetensors_refuses_is_refused_naming_the_file_and_tensor(tmp_path, entries, data_len, said):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_file(entries, np.arange(data_len, dtype=np.uint8).tobytes()))
    with pytest.raises(SafetensorError):  # the file is one safetensors itself refuses
        with safe_open(path, "np") as st:
            [st.get_tensor(k) for k in st.keys()]
    for read in (safetensors_io.SafetensorsFile, safetensors_io.safetensors_header, safetensors_io.read_numpy):
        with pytest.raises(ValueError) as refused:
            read(path)
        assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value), str(refused.value)
    if "the file has" in said:
        size = path.stat().st_size
        assert f"truncated: its tensors need {size + 8} bytes, the file has {size} (tensor 'rows' ends past it)" \
            in str(refused.value)


def test_a_checkpoint_safetensors_writes_passes_with_every_dtype_sized_fp8_included(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(save({"b": np.zeros((3, 5), np.float16), "a": np.arange(4, dtype=np.int64),
                           "empty": np.zeros((0, 7), np.float32)}))
    assert safetensors_io.read_numpy(path)["a"].tolist() == [0, 1, 2, 3]
    # fp8 and fp4 tensors beside: sized by their bits (F4: two to a byte); the reader does not read them.
    safetensors_io.check_layout("x", {"w": {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]},
                                      "s": {"dtype": "F4", "shape": [2, 4], "data_offsets": [16, 20]}}, 8, 28)
    with pytest.raises(ValueError, match=r"tensor 's' data_offsets \[0, 2\] do not fit its shape \[1, 3\] and dtype "
                                         r"F4 \(1.5 bytes\)"):  # half a byte left over: safetensors' MisalignedSlice
        safetensors_io.check_layout("x", {"s": {"dtype": "F4", "shape": [1, 3], "data_offsets": [0, 2]}}, 8, None)
