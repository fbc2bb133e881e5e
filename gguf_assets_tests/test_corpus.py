"""Tests for reading, cleaning, deduplicating and splitting prompts (gguf_assets.lib.corpus)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from gguf_assets.lib.corpus import (
    CorpusError,
    build_corpus,
    clean,
    empty_count,
    read_prompt_file,
    read_split,
    shard_prompts,
)
from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.settings import Settings, replace


def _settings(**corpus) -> Settings:
    return replace(Settings(), corpus=corpus, materials={"student": "x"})


def _write_jsonl(path: Path, texts: list, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def _dataset(path: Path, text_field: str = "text") -> dict:
    return {"datasets": [{"source": "test/prompts", "path": str(path), "text_field": text_field}]}


def _prompts(n: int, prefix: str = "prompt") -> list[str]:
    return [f"{prefix} number {i} about a cat" for i in range(n)]


@pytest.fixture
def project(tmp_path) -> ProjectPaths:
    return ProjectPaths.of(tmp_path / "project")


# -- helpers ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, fraction, expected", [(1000, 0.01, 10), (60000, 0.01, 600), (10, 0.01, 1),
                                                    (5, 0.0, 0), (100, 0.5, 50), (3, 0.1, 1), (150, 0.01, 2)])
def test_empty_count(n, fraction, expected):
    assert empty_count(n, fraction) == expected


def test_clean_normalizes_to_nfc_and_strips():
    decomposed = "Cafe\u0301"
    assert clean(f"  {decomposed}\t\n") == "Caf\u00e9"
    assert clean(decomposed) == unicodedata.normalize("NFC", decomposed)


def test_shard_prompts_covers_everything_in_order():
    prompts = [str(i) for i in range(7)]
    shards = shard_prompts(prompts, 3)
    assert shards == [["0", "1", "2"], ["3", "4", "5"], ["6"]]


# -- build_corpus ---------------------------------------------------------------------------

def test_same_seed_gives_byte_identical_files_other_seed_another_order(tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(300))
    outputs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        paths = ProjectPaths.of(tmp_path / name)
        manifest = build_corpus(paths, _settings(train_prompts=200, val_prompts=50, seed=seed), _dataset(data),
                                fingerprint="fp")
        outputs[name] = ({s: paths.corpus_file(s).read_bytes() for s in ("train", "val")}, manifest)
    assert outputs["a"][0] == outputs["b"][0]
    assert outputs["a"][1] == outputs["b"][1]
    assert outputs["a"][0]["train"] != outputs["c"][0]["train"]
    assert outputs["a"][0]["val"] != outputs["c"][0]["val"]
    assert outputs["a"][1]["splits"]["train"]["sha256"] != outputs["c"][1]["splits"]["train"]["sha256"]


def test_splits_have_requested_sizes_no_overlap_and_empty_prompts(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(500))
    manifest = build_corpus(project, _settings(train_prompts=300, val_prompts=100, empty_fraction=0.05),
                            _dataset(data), fingerprint="abc")
    train, val = read_split(project, "train"), read_split(project, "val")
    assert len(train) == 300 and len(val) == 100
    assert train.count("") == empty_count(300, 0.05) == 15
    assert val.count("") == empty_count(100, 0.05) == 5
    non_empty_train, non_empty_val = [t for t in train if t], [t for t in val if t]
    assert not set(non_empty_train) & set(non_empty_val)
    assert len(set(non_empty_train)) == len(non_empty_train)
    assert set(non_empty_train) | set(non_empty_val) <= set(_prompts(500))
    assert manifest["fingerprint"] == "abc"
    assert manifest["splits"]["train"] == {"prompts": 300, "empty": 15,
                                           "sha256": manifest["splits"]["train"]["sha256"]}
    assert manifest["splits"]["val"]["empty"] == 5
    assert manifest["counts"]["kept"] == 500
    assert manifest["counts"]["unused"] == 500 - (285 + 95)
    assert manifest["per_source"] == {"test/prompts": 500}
    assert json.loads(project.corpus_manifest.read_text()) == manifest


def test_empty_prompts_are_not_all_at_the_end(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(400))
    build_corpus(project, _settings(train_prompts=300, val_prompts=50, empty_fraction=0.2), _dataset(data),
                 fingerprint="x")
    train = read_split(project, "train")
    positions = [i for i, t in enumerate(train) if t == ""]
    assert len(positions) == 60
    assert positions != list(range(240, 300))  # shuffled in, not appended


def test_zero_empty_fraction_gives_no_empty_prompts(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(100))
    build_corpus(project, _settings(train_prompts=60, val_prompts=20, empty_fraction=0.0), _dataset(data),
                 fingerprint="x")
    assert "" not in read_split(project, "train") and "" not in read_split(project, "val")


def test_val_set_stays_fixed_when_train_grows(tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(400))
    vals = []
    for name, n_train in (("a", 100), ("b", 300)):
        paths = ProjectPaths.of(tmp_path / name)
        build_corpus(paths, _settings(train_prompts=n_train, val_prompts=40), _dataset(data), fingerprint="x")
        vals.append(paths.corpus_file("val").read_bytes())
    assert vals[0] == vals[1]


def test_duplicates_removed_and_counted_including_nfc_equivalents(project, tmp_path):
    composed, decomposed = "a caf\u00e9 at night", "a cafe\u0301 at night"
    assert composed != decomposed and unicodedata.normalize("NFC", decomposed) == composed
    texts = _prompts(20) + ["prompt number 3 about a cat", "  prompt number 4 about a cat  ", composed, decomposed]
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", texts)
    manifest = build_corpus(project, _settings(train_prompts=15, val_prompts=5, empty_fraction=0.0),
                            _dataset(data), fingerprint="x")
    assert manifest["counts"]["dropped_duplicate"] == 3
    assert manifest["counts"]["read"] == 24
    assert manifest["counts"]["kept"] == 21
    everything = read_split(project, "train") + read_split(project, "val")
    assert decomposed not in everything
    assert len(everything) == len(set(everything))


def test_duplicates_across_sources_and_per_source_counts(project, tmp_path):
    a = _write_jsonl(tmp_path / "a" / "p.jsonl", _prompts(30))
    b = _write_jsonl(tmp_path / "b" / "p.jsonl", _prompts(10) + _prompts(15, prefix="other"))
    materials = {"datasets": [{"source": "org/a", "path": str(a.parent), "text_field": "text"},
                              {"source": "org/b", "path": str(b), "text_field": "text"}]}
    manifest = build_corpus(project, _settings(train_prompts=30, val_prompts=10, empty_fraction=0.0), materials,
                            fingerprint="x")
    assert manifest["per_source"] == {"org/a": 30, "org/b": 15}
    assert manifest["counts"]["dropped_duplicate"] == 10


def test_length_filter_and_blank_lines_are_counted(project, tmp_path):
    texts = _prompts(30) + ["ab", "x", "y" * 101, "z" * 500, "   ", ""]
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", texts)
    manifest = build_corpus(project, _settings(train_prompts=20, val_prompts=5, min_chars=3, max_chars=100,
                                               empty_fraction=0.0), _dataset(data), fingerprint="x")
    assert manifest["counts"]["dropped_length"] == 4
    assert manifest["counts"]["dropped_blank"] == 2
    assert manifest["counts"]["kept"] == 30
    everything = read_split(project, "train") + read_split(project, "val")
    assert all(3 <= len(t) <= 100 for t in everything)


def test_length_bounds_are_inclusive(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", ["abc", "abcdefghij", "ab", "abcdefghijk"])
    manifest = build_corpus(project, _settings(train_prompts=1, val_prompts=1, min_chars=3, max_chars=10,
                                               empty_fraction=0.0), _dataset(data), fingerprint="x")
    assert manifest["counts"]["kept"] == 2 and manifest["counts"]["dropped_length"] == 2


def test_too_few_prompts_states_both_numbers(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(50))
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=100, val_prompts=10, empty_fraction=0.0), _dataset(data),
                     fingerprint="x")
    msg = str(info.value)
    assert "50 usable prompts" in msg and "110 non-empty prompts" in msg
    assert not project.corpus_file("train").exists()


def test_exactly_enough_prompts_is_fine(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(108))
    manifest = build_corpus(project, _settings(train_prompts=100, val_prompts=10, empty_fraction=0.01),
                            _dataset(data), fingerprint="x")  # 1 empty in each split
    assert manifest["counts"]["unused"] == 0


def test_custom_text_field(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(20), key="caption")
    build_corpus(project, _settings(train_prompts=10, val_prompts=5, empty_fraction=0.0),
                 _dataset(data, text_field="caption"), fingerprint="x")
    assert set(read_split(project, "train")) <= set(_prompts(20))


def test_dataset_folder_reads_all_prompt_files_in_sorted_order(project, tmp_path):
    folder = tmp_path / "ds"
    _write_jsonl(folder / "b" / "x.jsonl", _prompts(5, prefix="jsonl"))
    (folder / "a.txt").write_text("\n".join(_prompts(5, prefix="txt")) + "\n", encoding="utf-8")
    (folder / "c.json").write_text(json.dumps(_prompts(5, prefix="json")), encoding="utf-8")
    (folder / "README.md").write_text("not a prompt file", encoding="utf-8")
    manifest = build_corpus(project, _settings(train_prompts=10, val_prompts=5, empty_fraction=0.0),
                            _dataset(folder), fingerprint="x")
    assert manifest["counts"]["read"] == 15 and manifest["counts"]["kept"] == 15


def test_local_prompt_files_relative_to_project(project, tmp_path):
    project.root.mkdir(parents=True)
    (project.root / "extra.txt").write_text("\n".join(_prompts(12, prefix="local")), encoding="utf-8")
    manifest = build_corpus(project, _settings(train_prompts=8, val_prompts=2, empty_fraction=0.0,
                                               local_prompt_files=["extra.txt"]), {"datasets": []}, fingerprint="x")
    assert manifest["per_source"] == {"extra.txt": 12}


# -- bad input ------------------------------------------------------------------------------

def test_malformed_json_line_names_file_and_line(project, tmp_path):
    data = tmp_path / "data" / "a.jsonl"
    data.parent.mkdir()
    data.write_text('{"text": "one prompt"}\n\n{"text": "two"\n{"text": "three"}\n', encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=1, val_prompts=1), _dataset(data), fingerprint="x")
    assert f"{data}:3:" in str(info.value) and "not valid JSON" in str(info.value)


@pytest.mark.parametrize("line, got", [('{"prompt": "no text key"}', "NoneType"), ('{"text": 5}', "int"),
                                       ('{"text": null}', "NoneType"), ('["text"]', "NoneType")])
def test_missing_or_non_string_text_names_file_line_and_key(tmp_path, line, got):
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        list(read_prompt_file(data))
    msg = str(info.value)
    assert f"{data}:2:" in msg and "'text'" in msg and got in msg


def test_non_utf8_names_the_byte_offset(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"fine prompt\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=r"offset 16\b") as info:
        list(read_prompt_file(small))
    assert str(small) in str(info.value) and "UTF-8" in str(info.value)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_non_utf8_offset_is_from_the_start_of_a_large_file(tmp_path, suffix):
    # Text readers decode in chunks; the offset must still count from the start of the file.
    line = b'{"text": "a fine prompt"}\n' if suffix == ".jsonl" else b"a fine prompt\n"
    good = line * 3000
    data = tmp_path / f"big{suffix}"
    data.write_bytes(good + b"\xc3\x28\n")
    with pytest.raises(CorpusError, match=rf"offset {len(good)}\b"):
        list(read_prompt_file(data))


def test_empty_file_is_named(project, tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", _prompts(20))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    materials = {"datasets": [{"source": "a", "path": str(good), "text_field": "text"},
                              {"source": "b", "path": str(empty), "text_field": "text"}]}
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=5, val_prompts=2), materials, fingerprint="x")
    assert str(empty) in str(info.value) and "no prompts" in str(info.value)


def test_missing_local_prompt_file_is_named(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(20))
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=5, val_prompts=2, local_prompt_files=["missing/extra.txt"]),
                     _dataset(data), fingerprint="x")
    assert str(project.root / "missing" / "extra.txt") in str(info.value)
    assert "corpus.local_prompt_files" in str(info.value)
    assert not project.corpus_dir.exists()  # checked before anything is read or written


def test_dataset_folder_without_prompt_files(project, tmp_path):
    folder = tmp_path / "nothing"
    folder.mkdir()
    (folder / "notes.md").write_text("hi", encoding="utf-8")
    with pytest.raises(CorpusError, match="no prompt files") as info:
        build_corpus(project, _settings(train_prompts=1, val_prompts=1), _dataset(folder), fingerprint="x")
    assert str(folder) in str(info.value)


def test_txt_with_bom_and_crlf(tmp_path):
    data = tmp_path / "win.txt"
    data.write_bytes("\ufefffirst prompt\r\nsecond \u00e9\r\n\r\nthird".encode("utf-8"))
    assert list(read_prompt_file(data)) == ["first prompt", "second \u00e9", "", "third"]


def test_jsonl_with_bom_and_crlf(tmp_path):
    data = tmp_path / "win.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    assert list(read_prompt_file(data)) == ["first", "second"]


def test_bom_crlf_txt_builds_clean_corpus(project, tmp_path):
    data = tmp_path / "win.txt"
    data.write_bytes(("\ufeff" + "\r\n".join(_prompts(10)) + "\r\n").encode("utf-8"))
    build_corpus(project, _settings(train_prompts=6, val_prompts=2, empty_fraction=0.0), _dataset(data),
                 fingerprint="x")
    everything = read_split(project, "train") + read_split(project, "val")
    assert set(everything) <= set(_prompts(10))
    assert not any("\ufeff" in t or "\r" in t for t in everything)


def test_json_file_list_of_strings_and_objects(tmp_path):
    data = tmp_path / "p.json"
    data.write_text(json.dumps(["one", {"text": "two"}]), encoding="utf-8")
    assert list(read_prompt_file(data)) == ["one", "two"]
    data.write_text(json.dumps({"text": "not a list"}), encoding="utf-8")
    with pytest.raises(CorpusError, match="must hold a list"):
        list(read_prompt_file(data))
    data.write_text(json.dumps(["ok", 3]), encoding="utf-8")
    with pytest.raises(CorpusError, match="item 1"):
        list(read_prompt_file(data))


def test_malformed_json_file_names_file_and_line(tmp_path):
    data = tmp_path / "p.json"
    data.write_text('[\n  "one",\n  "two"\n  "three"\n]\n', encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        list(read_prompt_file(data))
    assert f"{data}:4:" in str(info.value) and "not valid JSON" in str(info.value)


def test_read_prompt_file_missing(tmp_path):
    with pytest.raises(CorpusError, match="not found") as info:
        list(read_prompt_file(tmp_path / "nope.txt"))
    assert str(tmp_path / "nope.txt") in str(info.value)
