"""materials.query_rows: one tensor of a bigger safetensors file, from the hub (by HTTP range) or a local file.

The teacher is served as a stock LLM repo with no query rows; the rows sit inside a text-to-image
checkpoint of another repo under a model-specific name, beside bigger tensors that must not be fetched.
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from gguf_assets.lib.materials import query_rows as qr
from gguf_assets.lib.materials.hub import HubOptions
from gguf_assets.lib.materials.materials_run import MaterialsError, load_manifest, manifest_is_current
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.project.settings import (
    SettingsError,
    load_settings,
    replace,
    settings_from_dict,
    write_project_file,
)

T2I, T2I_FILE, ROWS_NAME = "org/t2i-model", "transformer/model.safetensors", "text_proj.learned_query_tokens"
LLM = "stock/llm"
FAST = HubOptions(api_timeout_s=5, stall_timeout_s=5, attempts=3, retry_wait_s=0.05, disk_reserve_bytes=0,
                  chunk_bytes=64 << 10)


def _demo_rows(demo_materials_root: Path) -> torch.Tensor:
    return load_file(demo_materials_root / "teacher" / "query_rows.safetensors")["query_rows"]


def _t2i_checkpoint(rows: torch.Tensor) -> bytes:
    """A 'transformer' checkpoint: big tensors before and after the rows, one decoy of the right width."""
    g = torch.Generator().manual_seed(0)
    hidden = rows.shape[1]
    return save({
        "blocks.0.attn.weight": torch.randn(512, 512, generator=g),  # 1 MiB
        "blocks.1.mlp.weight": torch.randn(512, 512, generator=g),
        "blocks.0.norm.bias": torch.randn(hidden * 3, generator=g),  # 1-D: not a candidate
        ROWS_NAME: rows.clone(),
        "text_proj.in_proj.weight": torch.randn(8, hidden, generator=g),  # a decoy of the right width
        "vae.decoder.weight": torch.randn(256, 1024, generator=g),
    })


def _stock_llm(demo_materials_root: Path) -> dict[str, bytes]:
    """The demo teacher as a stock LLM repo: everything but its query rows file."""
    folder = demo_materials_root / "teacher"
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != "query_rows.safetensors"}


def _project(make_project, source: str, tensor: str = ROWS_NAME, file: str = T2I_FILE, **materials):
    return make_project(materials={"teacher": LLM, "query_rows": {"source": source, "file": file, "tensor": tensor},
                                   **materials})


# ---------------------------------------------------------------- header and range parsing (no I/O)

def _tiny_file() -> bytes:
    return save({"a": torch.zeros(3, 4), "rows": torch.arange(8, dtype=torch.float32).reshape(2, 4),
                 "b": torch.zeros(5, dtype=torch.float16)}, metadata={"format": "pt"})


def test_header_length_and_parse_and_span_find_the_tensor_bytes():
    data = _tiny_file()
    n = qr.header_length(data[:8], file_size=len(data))
    entries = qr.parse_header(data[8:8 + n])
    assert sorted(entries) == ["a", "b", "rows"]  # __metadata__ dropped
    start, end = qr.tensor_span(entries, "rows", n, file_size=len(data))
    rows = qr.rows_array(data[start:end], entries["rows"], "tiny")
    assert rows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_header_length_refuses_what_is_not_a_safetensors_file():
    with pytest.raises(qr.QueryRowsError, match="too short"):
        qr.header_length(b"\x01\x02", where="x")
    with pytest.raises(qr.QueryRowsError, match="not a safetensors file"):
        qr.header_length(struct.pack("<Q", 10_000), file_size=100, where="x")
    with pytest.raises(qr.QueryRowsError, match="not valid JSON"):
        qr.parse_header(b"{nope", where="x")


def test_span_refuses_offsets_that_do_not_fit_dtype_times_shape():
    entries = {"rows": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 30]}}
    with pytest.raises(qr.QueryRowsError, match="do not fit its shape"):
        qr.tensor_span(entries, "rows", 16)
    entries = {"rows": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}}
    with pytest.raises(qr.QueryRowsError, match="past the file"):
        qr.tensor_span(entries, "rows", 16, file_size=40)
    # Exotic dtypes elsewhere in a checkpoint are sized too (fp8 weights beside bf16 rows).
    assert qr.tensor_span({"w": {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]}}, "w", 8) == (16, 32)


def test_wrong_tensor_lists_the_2d_tensors_of_the_hidden_width():
    entries = {"x": {"dtype": "F32", "shape": [7, 64], "data_offsets": [0, 0]},
               "y": {"dtype": "F32", "shape": [64], "data_offsets": [0, 0]},
               "z": {"dtype": "BF16", "shape": [300, 64], "data_offsets": [0, 0]},
               "w": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 0]}}
    with pytest.raises(qr.QueryRowsError) as err:
        qr.check_choice(entries, "nope", 64, "repo:file")
    text = str(err.value)
    assert text.splitlines()[0].startswith("materials.query_rows.tensor = 'nope' is not in repo:file")
    assert text.splitlines()[1:] == ["  x  [7, 64]", "  z  [300, 64]"]
    with pytest.raises(qr.QueryRowsError, match=r"'w' has shape \[64, 32\], not Q x 64"):
        qr.check_choice(entries, "w", 64, "repo:file")
    assert qr.check_choice(entries, "z", 64, "f")["dtype"] == "BF16"


def test_rows_must_be_finite_and_whole():
    entry = {"dtype": "F32", "shape": [1, 2]}
    with pytest.raises(qr.QueryRowsError, match="non-finite"):
        qr.rows_array(np.array([1.0, np.nan], "<f4").tobytes(), entry, "f")
    with pytest.raises(qr.QueryRowsError, match="expected 8"):
        qr.rows_array(b"\0" * 4, entry, "f")


def test_stored_file_holds_the_rows_alone_in_their_dtype(tmp_path):
    rows = torch.randn(3, 4).to(torch.bfloat16)
    raw = rows.view(torch.int16).numpy().tobytes()
    path = tmp_path / "r.safetensors"
    path.write_bytes(qr.stored_bytes(raw, {"dtype": "BF16", "shape": [3, 4]}, {"source": "s"}))
    with safe_open(str(path), "pt") as fh:
        assert list(fh.keys()) == ["query_rows"] and fh.metadata() == {"source": "s"}
        assert torch.equal(fh.get_tensor("query_rows"), rows)


def test_setting_shape_is_checked():
    base = {"teacher": "a/b", "student": "c/d"}
    s = settings_from_dict({"materials": {**base, "query_rows": {"source": "o/t@v1", "file": "f.safetensors",
                                                                  "tensor": "t"}}})
    assert s.materials.query_rows == {"source": "o/t@v1", "file": "f.safetensors", "tensor": "t"}
    assert settings_from_dict({"materials": {**base, "query_rows": None}}).materials.query_rows == {}
    with pytest.raises(SettingsError, match="needs a non-empty tensor"):
        settings_from_dict({"materials": {**base, "query_rows": {"source": "o/t"}}})
    with pytest.raises(SettingsError, match="unknown keys"):
        settings_from_dict({"materials": {**base, "query_rows": {"source": "o/t", "tensor": "t", "dtype": "x"}}})


# ---------------------------------------------------------------- from the loopback hub

def test_rows_come_from_a_tensor_of_another_repo_by_range(make_project, loopback_hub, demo_materials_root):
    rows = _demo_rows(demo_materials_root)
    checkpoint = _t2i_checkpoint(rows)
    loopback_hub.add_repo(LLM, _stock_llm(demo_materials_root))
    loopback_hub.add_repo(T2I, {T2I_FILE: checkpoint, "README.md": b"# t2i\n"})
    paths = _project(make_project, f"{T2I}@main")

    manifest = resolve_materials(paths, load_settings(paths.root), hub_options=FAST)

    entry = manifest.query_rows
    assert entry["commit"] == loopback_hub.head(T2I) and entry["origin"] == "hub"
    assert entry["file_size"] == len(checkpoint) and len(entry["file_etag"]) == 64
    assert entry["shape"] == list(rows.shape) and entry["tensor"] == ROWS_NAME
    # Fetched by range: the header and the rows, far fewer bytes than the file.
    served = loopback_hub.served[T2I_FILE]
    assert served == entry["fetched_bytes"] < rows.numel() * 4 + 4096 < len(checkpoint) // 10
    assert all(r["range"] for r in loopback_hub.requests if r["path"].endswith(T2I_FILE) and r["method"] == "GET")
    stored = paths.materials_dir / "query_rows.safetensors"
    assert Path(entry["path"]) == stored
    assert torch.equal(load_file(stored)["query_rows"], rows)
    assert not (paths.materials_dir / qr.PARTIAL_DIR).exists()
    # The stock teacher was fetched without any query rows file.
    assert not (Path(manifest.teacher["path"]) / "query_rows.safetensors").exists()
    # Stored relative to the project, with the commit the setting resolved to.
    on_disk = json.loads(paths.materials_manifest.read_text())["query_rows"]
    assert on_disk["path"] == "materials/query_rows.safetensors" and on_disk["commit"] == entry["commit"]

    # A rerun reuses it after a stamp check, with no request for the file.
    settings = load_settings(paths.root)
    assert manifest_is_current(paths, settings)
    before = len(loopback_hub.requests)
    again = resolve_materials(paths, settings, hub_options=FAST)
    assert again.query_rows["tensor_sha256"] == entry["tensor_sha256"]
    assert not any(T2I_FILE in r["path"] for r in loopback_hub.requests[before:])

    # The teacher loads them (the backbone and its query rows) from the stored file.
    from gguf_assets.lib.precompute.teacher import load_query_rows

    where = qr.rows_location(settings, load_manifest(paths), Path(manifest.teacher["path"]))
    assert torch.equal(load_query_rows(Path(manifest.teacher["path"]), settings, rows.shape[1], where), rows)

    # An edited stored file is noticed, and the next run fetches the tensor again.
    stored.write_bytes(stored.read_bytes()[:-4] + b"\0\0\0\0")
    assert not manifest_is_current(paths, settings)
    resolve_materials(paths, settings, hub_options=FAST)
    assert torch.equal(load_file(stored)["query_rows"], rows)


def test_wrong_tensor_name_lists_the_candidates(make_project, loopback_hub, demo_materials_root):
    rows = _demo_rows(demo_materials_root)
    loopback_hub.add_repo(LLM, _stock_llm(demo_materials_root))
    loopback_hub.add_repo(T2I, {T2I_FILE: _t2i_checkpoint(rows)})
    paths = _project(make_project, T2I, tensor="query_tokens")

    with pytest.raises(qr.QueryRowsError) as err:
        resolve_materials(paths, load_settings(paths.root), hub_options=FAST)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"materials.query_rows.tensor = 'query_tokens' is not in {T2I}:{T2I_FILE}")
    assert lines[1:] == [f"  text_proj.in_proj.weight  [8, {rows.shape[1]}]", f"  {ROWS_NAME}  {list(rows.shape)}"]
    assert loopback_hub.served[T2I_FILE] < 4096  # the header only
    assert not (paths.materials_dir / qr.PARTIAL_DIR).exists()


def test_file_missing_from_the_repo_names_its_safetensors_files(make_project, loopback_hub, demo_materials_root):
    loopback_hub.add_repo(LLM, _stock_llm(demo_materials_root))
    loopback_hub.add_repo(T2I, {T2I_FILE: _t2i_checkpoint(_demo_rows(demo_materials_root))})
    paths = _project(make_project, T2I, file="model.safetensors")
    with pytest.raises(qr.QueryRowsError, match=f"file = 'model.safetensors' is not in {T2I}.*{T2I_FILE}"):
        resolve_materials(paths, load_settings(paths.root), hub_options=FAST)


def test_a_stock_teacher_without_the_setting_still_asks_for_query_rows(make_project, loopback_hub,
                                                                        demo_materials_root):
    loopback_hub.add_repo(LLM, _stock_llm(demo_materials_root))
    paths = make_project(materials={"teacher": LLM})
    with pytest.raises(MaterialsError, match="query_rows_file"):
        resolve_materials(paths, load_settings(paths.root), hub_options=FAST)


def test_rows_from_a_local_file(make_project, demo_materials_root, tmp_path):
    rows = _demo_rows(demo_materials_root)
    (tmp_path / "t2i").mkdir()
    (tmp_path / "t2i" / "model.safetensors").write_bytes(_t2i_checkpoint(rows))
    paths = make_project(materials={"query_rows": {"source": str(tmp_path / "t2i" / "model.safetensors"),
                                                   "file": "", "tensor": ROWS_NAME}})
    manifest = resolve_materials(paths, load_settings(paths.root))
    assert manifest.query_rows["origin"] == "local" and manifest.query_rows["commit"].startswith("local:")
    # `gguf-trainer verify` checks the stored rows against their sha256, as made by the project.
    from gguf_assets.lib.status.verify_project import recorded_files

    stored = [f for f in recorded_files(paths, load_settings(paths.root)) if f.path.name == "query_rows.safetensors"
              and f.path.parent == paths.materials_dir]
    assert [(f.hash_kind, f.expected, f.owner) for f in stored] == [
        ("sha256", manifest.query_rows["stored"]["sha256"], "project")]
    assert torch.equal(load_file(paths.materials_dir / "query_rows.safetensors")["query_rows"], rows)
    assert manifest_is_current(paths, load_settings(paths.root))

    # Another tensor named: the manifest is no longer current, and the next run takes that one.
    settings = replace(load_settings(paths.root), materials={"query_rows": {
        **load_settings(paths.root).materials.query_rows, "tensor": "text_proj.in_proj.weight"}})
    write_project_file(paths.root, settings)
    assert not manifest_is_current(paths, load_settings(paths.root))
    manifest = resolve_materials(paths, load_settings(paths.root))
    assert manifest.query_rows["shape"] == [8, rows.shape[1]] and manifest.query_rows["tensor"] != ROWS_NAME
    assert load_file(paths.materials_dir / "query_rows.safetensors")["query_rows"].shape == (8, rows.shape[1])


def _rows_inside_another_tensor(rows: torch.Tensor) -> bytes:
    """A checkpoint whose header points the rows into the middle of another tensor's bytes (safetensors refuses
    it: InvalidOffset); the bytes it would give are a real tensor's, of the right size and all finite."""
    size = rows.numel() * 4
    entries = {"blocks.0.attn.weight": {"dtype": "F32", "shape": [2 * rows.shape[0], rows.shape[1]],
                                        "data_offsets": [0, 2 * size]},
               ROWS_NAME: {"dtype": "F32", "shape": list(rows.shape), "data_offsets": [size, 2 * size]}}
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + torch.randn(2 * rows.shape[0], rows.shape[1]).numpy().tobytes()


def test_rows_that_overlap_another_tensor_are_refused_naming_both_and_nothing_is_stored(make_project, tmp_path,
                                                                                         demo_materials_root):
    rows = _demo_rows(demo_materials_root).float()
    data = _rows_inside_another_tensor(rows)
    n = qr.header_length(data[:8], file_size=len(data))
    with pytest.raises(qr.QueryRowsError) as refused:  # the header check the hub's ranged read makes too
        qr.parse_header(data[8:8 + n], where="org/t2i:model.safetensors at abc", file_size=len(data))
    assert str(refused.value).startswith(f"materials.query_rows: org/t2i:model.safetensors at abc: tensor "
                                         f"{ROWS_NAME!r} data_offsets") and "overlap tensor 'blocks.0.attn.weight'" \
        in str(refused.value), str(refused.value)

    checkpoint = tmp_path / "t2i.safetensors"
    checkpoint.write_bytes(data)
    paths = make_project(materials={"query_rows": {"source": str(checkpoint), "file": "", "tensor": ROWS_NAME}})
    with pytest.raises(qr.QueryRowsError) as refused:
        resolve_materials(paths, load_settings(paths.root))
    message = str(refused.value)
    assert f"{checkpoint}: tensor {ROWS_NAME!r}" in message and "'blocks.0.attn.weight'" in message, message
    assert "Nothing was stored" in message and "\n" not in message
    assert not (paths.materials_dir / qr.ROWS_FILE).exists()
    assert not paths.materials_manifest.exists()  # no manifest records rows for the setting


def test_a_dropped_connection_resumes_the_tensor_from_what_arrived(make_project, loopback_hub, demo_materials_root):
    rows = _demo_rows(demo_materials_root)
    checkpoint = _t2i_checkpoint(rows)
    n = qr.header_length(checkpoint[:8])
    start, end = qr.tensor_span(qr.parse_header(checkpoint[8:8 + n]), ROWS_NAME, n)
    loopback_hub.add_repo(LLM, _stock_llm(demo_materials_root))
    loopback_hub.add_repo(T2I, {T2I_FILE: checkpoint})
    # Every GET of the file is cut at the middle of the rows: the prefix and header arrive whole, the rows half.
    loopback_hub.add_fault("drop", path_contains=T2I_FILE, times=3, after_bytes=(start + end) // 2)
    paths = _project(make_project, T2I)

    manifest = resolve_materials(paths, load_settings(paths.root), hub_options=FAST)

    assert torch.equal(load_file(paths.materials_dir / "query_rows.safetensors")["query_rows"], rows)
    ranges = [r["range"] for r in loopback_hub.requests if r["path"].endswith(T2I_FILE) and r["method"] == "GET"]
    assert ranges[:3] == ["bytes=0-7", f"bytes=8-{7 + n}", f"bytes={start}-{end - 1}"]
    resumed = int(ranges[3].removeprefix("bytes=").split("-")[0])
    assert start < resumed <= (start + end) // 2 and ranges[3].endswith(f"-{end - 1}")
    assert loopback_hub.served[T2I_FILE] < 8 + n + 2 * (end - start)
    assert manifest.query_rows["tensor_sha256"]


def test_the_targets_fingerprint_follows_the_rows_content_only_when_the_setting_is_set():
    from gguf_assets.lib.precompute.shards_run import half_fingerprint
    from gguf_assets.lib.project.manifests import MaterialsManifest

    base = settings_from_dict({"materials": {"teacher": "a/b", "student": "c/d"}})
    teacher = {"source": "a/b", "commit": "c" * 40}
    unset = half_fingerprint("teacher", base, MaterialsManifest(teacher=teacher), "p")
    # Unset: a stray query_rows entry changes nothing (the teacher folder's file is what the pin covers).
    assert half_fingerprint("teacher", base, MaterialsManifest(teacher=teacher, query_rows={"tensor_sha256": "x"}),
                            "p") == unset
    rows = {"source": "o/t", "file": "f.safetensors", "tensor": "q"}
    set_ = replace(base, materials={"query_rows": rows})
    one = half_fingerprint("teacher", set_, MaterialsManifest(teacher=teacher, query_rows={"tensor_sha256": "x"}), "p")
    two = half_fingerprint("teacher", set_, MaterialsManifest(teacher=teacher, query_rows={"tensor_sha256": "y"}), "p")
    assert len({unset, one, two}) == 3
    assert half_fingerprint("student", set_, MaterialsManifest(teacher=teacher), "p") == \
        half_fingerprint("student", base, MaterialsManifest(teacher=teacher), "p")


def test_a_project_resolved_before_the_setting_existed_stays_current(make_project):
    """Upgrading must not make every project's materials stale: unset, materials.query_rows is not part of the
    settings a manifest records (a manifest written before the key existed holds no such key)."""
    from gguf_assets.lib.core import atomic
    from gguf_assets.lib.materials.materials_run import materials_settings_key

    paths = make_project(steps=5, mock_teacher=True)
    settings = load_settings(paths.root)
    assert "query_rows" not in materials_settings_key(settings)
    resolve_materials(paths, settings)
    recorded = atomic.read_json(paths.materials_manifest)
    assert "query_rows" not in recorded["settings"]  # what an older version wrote, too
    assert manifest_is_current(paths, settings)
    rows = {"source": "o/t", "file": "f.safetensors", "tensor": "q"}
    assert not manifest_is_current(paths, replace(settings, materials={"query_rows": rows}))


def test_rows_whose_offsets_run_past_the_end_are_refused_naming_the_rows_first(make_project, tmp_path,
                                                                                demo_materials_root):
    """The header's first problem is another tensor's (sorted by offset); the refusal names the tensor asked for
    first, then that problem."""
    rows = _demo_rows(demo_materials_root).float()
    size = rows.numel() * 4
    entries = {ROWS_NAME: {"dtype": "F32", "shape": list(rows.shape), "data_offsets": [0, size]},
               "blocks.1.mlp.weight": {"dtype": "F32", "shape": list(rows.shape), "data_offsets": [size, 2 * size]}}
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    checkpoint = tmp_path / "t2i.safetensors"
    checkpoint.write_bytes(struct.pack("<Q", len(raw)) + raw + rows.numpy().tobytes())  # the second tensor cut off
    paths = make_project(materials={"query_rows": {"source": str(checkpoint), "file": "", "tensor": ROWS_NAME}})
    with pytest.raises(qr.QueryRowsError) as refused:
        resolve_materials(paths, load_settings(paths.root))
    message = str(refused.value)
    assert message.startswith(f"materials.query_rows.tensor = {ROWS_NAME!r}: {checkpoint} cannot be read"), message
    assert "'blocks.1.mlp.weight'" in message and "Nothing was stored" in message
