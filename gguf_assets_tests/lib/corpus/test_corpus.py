"""Tests for reading, cleaning, deduplicating and splitting prompts (gguf_assets.lib.corpus.corpus)."""

from __future__ import annotations

import codecs
import gzip
import json
import unicodedata
from pathlib import Path

import pytest

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.corpus import corpus as corpus_lib
from gguf_assets.lib.corpus import prompt_files
from gguf_assets.lib.corpus.corpus import build_corpus, clean, empty_count, read_split, shard_prompts
from gguf_assets.lib.corpus.prompt_files import CorpusError, check_prompt_files, read_prompt_file
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import CorpusManifest, MaterialsManifest
from gguf_assets.lib.project.settings import Settings, replace


def _settings(**corpus) -> Settings:
    return replace(Settings(), corpus=corpus, materials={"student": "x"})


def _write_jsonl(path: Path, texts: list, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def _dataset(path: Path, text_field: str = "text") -> MaterialsManifest:
    return MaterialsManifest(datasets=[{"source": "test/prompts", "path": str(path), "text_field": text_field}])


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

def without_stamps(manifest: CorpusManifest) -> dict:
    """A corpus manifest without its files' mtimes and inodes, which are the disk's, not the corpus's."""
    return {**manifest.to_json(), "splits": {s: verify.without_stamp(m) for s, m in manifest.splits.items()}}


def test_same_seed_gives_byte_identical_files_other_seed_another_order(tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(300))
    outputs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        paths = ProjectPaths.of(tmp_path / name)
        manifest = build_corpus(paths, _settings(train_prompts=200, val_prompts=50, seed=seed), _dataset(data),
                                fingerprint="fp")
        outputs[name] = ({s: paths.corpus_file(s).read_bytes() for s in ("train", "val")}, manifest)
    assert outputs["a"][0] == outputs["b"][0]
    assert without_stamps(outputs["a"][1]) == without_stamps(outputs["b"][1])
    assert outputs["a"][0]["train"] != outputs["c"][0]["train"]
    assert outputs["a"][0]["val"] != outputs["c"][0]["val"]
    assert outputs["a"][1].splits["train"]["sha256"] != outputs["c"][1].splits["train"]["sha256"]


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
    assert manifest.fingerprint == "abc"
    assert manifest.splits["train"] == {"prompts": 300, "empty": 15, **verify.record(project.corpus_file("train"))}
    assert manifest.splits["val"]["empty"] == 5
    assert manifest.counts["kept"] == 500
    assert manifest.counts["unused"] == 500 - (285 + 95)
    assert manifest.per_source == {"test/prompts": 500}
    assert json.loads(project.corpus_manifest.read_text()) == manifest.to_json()


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
    assert manifest.counts["dropped_duplicate"] == 3
    assert manifest.counts["read"] == 24
    assert manifest.counts["kept"] == 21
    everything = read_split(project, "train") + read_split(project, "val")
    assert decomposed not in everything
    assert len(everything) == len(set(everything))


def test_duplicates_across_sources_and_per_source_counts(project, tmp_path):
    a = _write_jsonl(tmp_path / "a" / "p.jsonl", _prompts(30))
    b = _write_jsonl(tmp_path / "b" / "p.jsonl", _prompts(10) + _prompts(15, prefix="other"))
    materials = MaterialsManifest(datasets=[{"source": "org/a", "path": str(a.parent), "text_field": "text"},
                              {"source": "org/b", "path": str(b), "text_field": "text"}])
    manifest = build_corpus(project, _settings(train_prompts=30, val_prompts=10, empty_fraction=0.0), materials,
                            fingerprint="x")
    assert manifest.per_source == {"org/a": 30, "org/b": 15}
    assert manifest.counts["dropped_duplicate"] == 10


def test_length_filter_and_blank_lines_are_counted(project, tmp_path):
    texts = _prompts(30) + ["ab", "x", "y" * 101, "z" * 500, "   ", ""]
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", texts)
    manifest = build_corpus(project, _settings(train_prompts=20, val_prompts=5, min_chars=3, max_chars=100,
                                               empty_fraction=0.0), _dataset(data), fingerprint="x")
    assert manifest.counts["dropped_length"] == 4
    assert manifest.counts["dropped_blank"] == 2
    assert manifest.counts["kept"] == 30
    everything = read_split(project, "train") + read_split(project, "val")
    assert all(3 <= len(t) <= 100 for t in everything)


def test_length_bounds_are_inclusive(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", ["abc", "abcdefghij", "ab", "abcdefghijk"])
    manifest = build_corpus(project, _settings(train_prompts=1, val_prompts=1, min_chars=3, max_chars=10,
                                               empty_fraction=0.0), _dataset(data), fingerprint="x")
    assert manifest.counts["kept"] == 2 and manifest.counts["dropped_length"] == 2


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
    assert manifest.counts["unused"] == 0


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
    (folder / "dataset_info.json").write_text('{"features": {}}', encoding="utf-8")  # hub metadata, not prompts
    (folder / "d.csv.gz").write_bytes(gzip.compress(("text\n" + "\n".join(_prompts(5, prefix="csv"))).encode()))
    manifest = build_corpus(project, _settings(train_prompts=10, val_prompts=5, empty_fraction=0.0),
                            _dataset(folder), fingerprint="x")
    assert manifest.counts["read"] == 20 and manifest.counts["kept"] == 20
    assert [Path(s["file"]).name for s in manifest.sources] == ["a.txt", "x.jsonl", "c.json", "d.csv.gz"]


def test_local_prompt_files_relative_to_project(project, tmp_path):
    project.root.mkdir(parents=True)
    (project.root / "extra.txt").write_text("\n".join(_prompts(12, prefix="local")), encoding="utf-8")
    manifest = build_corpus(project, _settings(train_prompts=8, val_prompts=2, empty_fraction=0.0,
                                               local_prompt_files=["extra.txt"]), MaterialsManifest(), fingerprint="x")
    assert manifest.per_source == {"extra.txt": 12}


def test_the_corpus_fingerprint_rereads_a_local_file_only_when_its_stamp_changed(project, monkeypatch):
    from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint

    project.root.mkdir(parents=True)
    extra = project.root / "extra.txt"
    extra.write_text("\n".join(_prompts(12, prefix="local")), encoding="utf-8")
    settings = _settings(train_prompts=8, val_prompts=2, empty_fraction=0.0, local_prompt_files=["extra.txt"])
    before = corpus_fingerprint(project, settings, MaterialsManifest())
    build_corpus(project, settings, MaterialsManifest(), fingerprint=before)
    real_sha256, hashed = atomic.sha256_file, []
    monkeypatch.setattr(atomic, "sha256_file", lambda path, **kw: hashed.append(path) or real_sha256(path, **kw))
    assert corpus_fingerprint(project, settings, MaterialsManifest()) == before and hashed == []
    extra.write_text("\n".join(_prompts(12, prefix="other")), encoding="utf-8")  # same size, new content
    assert corpus_fingerprint(project, settings, MaterialsManifest()) != before and hashed == [extra]


# -- bad input ------------------------------------------------------------------------------

def test_malformed_json_line_names_file_and_line(project, tmp_path):
    data = tmp_path / "data" / "a.jsonl"
    data.parent.mkdir()
    data.write_text('{"text": "one prompt"}\n\n{"text": "two"\n{"text": "three"}\n', encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=1, val_prompts=1), _dataset(data), fingerprint="x")
    assert f"{data}:3:" in str(info.value) and "not valid JSON" in str(info.value)


@pytest.mark.parametrize("line, got", [('{"prompt": "no text key"}', "is missing (the object has 'prompt')"),
                                       ('{"text": 5}', "is a number"), ('{"text": null}', "is null"),
                                       ('{"text": ["a"]}', "is a list"), ('["text"]', "got a list")])
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
    materials = MaterialsManifest(datasets=[{"source": "a", "path": str(good), "text_field": "text"},
                              {"source": "b", "path": str(empty), "text_field": "text"}])
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


# -- formats: gzip, csv, streamed .json -------------------------------------------------------

def _gz(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data, mtime=0))
    return path


@pytest.mark.parametrize("name, body", [
    ("p.txt.gz", "\ufeffone\r\ntwo\r\n"),
    ("p.jsonl.gz", '\ufeff{"text": "one"}\r\n{"text": "two"}\r\n'),
    ("p.json.gz", '\ufeff[\r\n"one",\r\n{"text": "two"}\r\n]\r\n'),
    ("p.csv.gz", "\ufeffid,text\r\n1,one\r\n2,two\r\n"),
])
def test_gzip_bom_crlf_in_every_format(tmp_path, name, body):
    data = _gz(tmp_path / name, body.encode("utf-8"))
    assert list(read_prompt_file(data)) == ["one", "two"]


def test_csv_named_column_quotes_and_multiline_cells(tmp_path):
    data = tmp_path / "p.csv"
    data.write_text('id,caption,other\n1,"a cat, sitting",x\n2,"two\nlines ""quoted""",y\n3,plain,z\n',
                    encoding="utf-8")
    assert list(read_prompt_file(data, text_field="caption")) == ["a cat, sitting", 'two\nlines "quoted"', "plain"]


def test_csv_missing_column_names_file_and_columns(tmp_path):
    data = tmp_path / "p.csv"
    data.write_text("id,prompt\n1,hello\n", encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        list(read_prompt_file(data))
    msg = str(info.value)
    assert f"{data}:1:" in msg and "no column 'text'" in msg and "'prompt'" in msg and "corpus.text_field" in msg


def test_csv_short_row_names_line(tmp_path):
    data = tmp_path / "p.csv"
    data.write_text("id,text\n1,fine\n2\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"{data}:3: the row has 1 fields"):
        list(read_prompt_file(data))


def test_local_files_use_corpus_text_field(project, tmp_path):
    project.root.mkdir(parents=True)
    (project.root / "p.csv").write_text("caption\n" + "\n".join(_prompts(10, "csv")) + "\n", encoding="utf-8")
    _write_jsonl(project.root / "p.jsonl", _prompts(10, "jsonl"), key="caption")
    manifest = build_corpus(project, _settings(train_prompts=15, val_prompts=5, empty_fraction=0.0,
                                               text_field="caption", local_prompt_files=["p.csv", "p.jsonl"]),
                            MaterialsManifest(), fingerprint="x")
    assert manifest.per_source == {"p.csv": 10, "p.jsonl": 10}


def test_json_list_streams_across_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "READ_CHUNK_BYTES", 64)  # items and numbers straddle window edges
    items = [f"prompt {i} " + "é" * (i % 7) for i in range(200)]
    data = tmp_path / "p.json"
    data.write_text(json.dumps([{"text": t} if i % 2 else t for i, t in enumerate(items)], indent=1),
                    encoding="utf-8")
    assert list(read_prompt_file(data)) == items
    data.write_text(json.dumps(["a", "b"] * 40 + [12345678901234567890]), encoding="utf-8")
    with pytest.raises(CorpusError, match=r"item 80: expected an object with a string 'text', got a number"):
        list(read_prompt_file(data))


def test_json_item_errors_name_line_item_and_key(tmp_path):
    data = tmp_path / "p.json"
    data.write_text('[\n "one",\n {"text": null},\n "two"\n]\n', encoding="utf-8")
    with pytest.raises(CorpusError) as info:
        list(read_prompt_file(data))
    assert f"{data}:3: item 1: key 'text' is null" in str(info.value)
    assert list(read_prompt_file(data, skip_bad_lines=True)) == ["one", "two"]


def _json_with_bad_items(path: Path, n: int) -> tuple[list[str], list[str]]:
    """A pretty-printed .json list of n items (strings, and objects over three lines), every 97th one bad; the
    prompts and the bad records' messages as the reader must give them, their lines found in the text."""
    items = [3 if i % 97 == 50 else {"text": f"prompt {i}"} if i % 3 else f"prompt {i}" for i in range(n)]
    text = json.dumps(items, indent=1)
    path.write_text(text, encoding="utf-8")
    lines = text.splitlines()
    bad_lines = iter(no for no, line in enumerate(lines, 1) if line.strip() in ("3", "3,"))
    prompts = [t["text"] if isinstance(t, dict) else t for t in items if t != 3]
    bad = [f"{path}:{next(bad_lines)}: item {i}: expected an object with a string 'text', got a number."
           for i, t in enumerate(items) if t == 3]
    return prompts, bad


def test_json_bad_items_deep_in_the_file_name_their_lines(tmp_path, monkeypatch):
    """The window slides many times (small read chunks); each bad item still names its own line."""
    monkeypatch.setattr(prompt_files, "READ_CHUNK_BYTES", 256)
    prompts, bad = _json_with_bad_items(tmp_path / "p.json", 3000)
    records = list(prompt_files.PromptFile(tmp_path / "p.json", "text").records())
    assert [r for r in records if type(r) is str] == prompts
    assert [r.message for r in records if type(r) is not str] == bad and len(bad) == 31


def test_json_reading_counts_each_newline_once(tmp_path, monkeypatch):
    """Lines are counted for bad items and window moves only, each stretch of text once: recounting from the
    window's start for every item made a .json list read about 150 times slower than the same prompts as .jsonl."""
    data = tmp_path / "p.json"
    prompts, bad = _json_with_bad_items(data, 3000)
    scanned = []
    count = prompt_files._count_newlines
    monkeypatch.setattr(prompt_files, "_count_newlines",
                        lambda text, start, end: scanned.append(end - start) or count(text, start, end))
    records = list(prompt_files.PromptFile(data, "text").records())
    assert [r.message for r in records if type(r) is not str] == bad
    assert len(scanned) <= len(bad) + 2 and sum(scanned) <= len(data.read_text(encoding="utf-8")), (
        len(scanned), sum(scanned))


@pytest.mark.parametrize("body, expected", [("[\"a\", \"b\"", "the list is not closed"),
                                            ('["a"] x', "after the closing"),
                                            ('{"text": "a"}', "does not start with a list")])
def test_json_structure_errors(tmp_path, body, expected):
    data = tmp_path / "p.json"
    data.write_text(body, encoding="utf-8")
    with pytest.raises(CorpusError, match=expected):
        list(read_prompt_file(data))


def test_non_utf8_in_gzip_names_decompressed_offset(tmp_path):
    data = _gz(tmp_path / "p.txt.gz", b"good line\nbad \xff\n")
    with pytest.raises(CorpusError, match=r"offset 14 of the decompressed data"):
        list(read_prompt_file(data))


def test_non_utf8_in_json_names_offset_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "READ_CHUNK_BYTES", 16)
    body = ('["' + "é" * 20 + '", "').encode() + b"\xe9x" + b'"]'
    data = tmp_path / "p.json"
    data.write_bytes(codecs.BOM_UTF8 + body)
    bad_at = len(codecs.BOM_UTF8) + body.index(b"\xe9x")
    with pytest.raises(CorpusError, match=rf"offset {bad_at}\b"):
        list(read_prompt_file(data))


def test_corrupt_gzip_is_a_clear_error(tmp_path):
    data = tmp_path / "p.txt.gz"
    data.write_bytes(b"this is not gzip at all\n")
    with pytest.raises(CorpusError, match="not a valid gzip file"):
        list(read_prompt_file(data))
    full = gzip.compress(b"one\ntwo\n" * 1000)
    data.write_bytes(full[: len(full) // 2])
    with pytest.raises(CorpusError, match="not a valid gzip file"):
        list(read_prompt_file(data))


def test_unsupported_suffix_is_named(tmp_path):
    data = tmp_path / "p.xlsx"
    data.write_bytes(b"PK")
    with pytest.raises(CorpusError, match=r"unsupported prompt file type.*\.csv"):
        list(read_prompt_file(data))


def test_overlong_line_is_a_bad_record_not_unbounded_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "MAX_RECORD_BYTES", 1000)
    data = tmp_path / "p.txt"
    data.write_text("first\n" + "x" * 5000 + "\nlast\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"{data}:2: line longer than"):
        list(read_prompt_file(data))
    assert list(read_prompt_file(data, skip_bad_lines=True)) == ["first", "last"]


def test_one_megabyte_line_is_read_and_dropped_for_length(project, tmp_path):
    data = tmp_path / "p.jsonl"
    _write_jsonl(data, _prompts(20) + ["y" * (1 << 20)])
    manifest = build_corpus(project, _settings(train_prompts=10, val_prompts=5, empty_fraction=0.0), _dataset(data),
                            fingerprint="x")
    assert manifest.counts["dropped_length"] == 1 and manifest.counts["kept"] == 20


# -- bad input: skipping, pre-checks ------------------------------------------------------------

def _bad_jsonl(path: Path) -> Path:
    lines = [json.dumps({"text": t}) for t in _prompts(30)]
    lines[3] = '{"text": "unclosed'
    lines[7] = '{"text": 7}'
    lines[11] = '{"caption": "x"}'
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff byte"}\n')
    return path


def test_bad_lines_stop_the_build_with_the_fix(project, tmp_path):
    data = _bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=10, val_prompts=5), _dataset(data), fingerprint="x")
    assert f"{data}:4: not valid JSON" in str(info.value) and "corpus.skip_bad_lines" in str(info.value)
    assert not project.corpus_file("train").exists()


def test_skip_bad_lines_counts_and_samples_them(project, tmp_path):
    data = _bad_jsonl(tmp_path / "bad.jsonl")
    manifest = build_corpus(project, _settings(train_prompts=20, val_prompts=5, empty_fraction=0.0,
                                               skip_bad_lines=True), _dataset(data), fingerprint="x")
    assert manifest.counts["skipped_bad_lines"] == 4
    assert manifest.counts["read"] == 27 and manifest.counts["kept"] == 27
    assert manifest.sources[0]["skipped_bad_lines"] == 4
    samples = manifest.bad_line_samples
    assert [s.split(": ")[0] for s in samples] == [f"{data}:{n}" for n in (4, 8, 12, 31)]
    assert "offset" in samples[3] and "key 'text' is a number" in samples[1]


@pytest.mark.parametrize("body", [b"", b"   \n\n\t\n", b"\r\n\r\n"])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".json", ".csv"])
def test_empty_or_whitespace_only_file_is_named(project, tmp_path, suffix, body):
    project.root.mkdir(parents=True)
    (project.root / f"p{suffix}").write_bytes(body)
    with pytest.raises(CorpusError, match="holds no prompts|is empty") as info:
        check_prompt_files(project, _settings(local_prompt_files=[f"p{suffix}"]))
    assert str(project.root / f"p{suffix}") in str(info.value)


def test_file_of_only_blank_prompts_found_after_the_precheck_window(project, tmp_path):
    data = _write_jsonl(tmp_path / "blank.jsonl", [" "] * 20)  # records parse, but no prompt anywhere
    with pytest.raises(CorpusError, match=f"{data}: the file holds no prompts"):
        build_corpus(project, _settings(train_prompts=1, val_prompts=1), _dataset(data), fingerprint="x")


def test_check_prompt_files_reads_only_the_start(project, tmp_path):
    project.root.mkdir(parents=True)
    data = project.root / "p.jsonl"
    data.write_text('{"text": "fine"}\n' * 20 + "not json at all\n", encoding="utf-8")
    settings = _settings(local_prompt_files=["p.jsonl"])
    assert check_prompt_files(project, settings) == [data]  # a bad line late in the file is the full pass's job
    data.write_text('{"text": "fine"}\nnot json\n' + '{"text": "fine"}\n' * 20, encoding="utf-8")
    with pytest.raises(CorpusError, match=f"{data}:2: not valid JSON"):
        check_prompt_files(project, settings)
    assert check_prompt_files(project, replace(settings, corpus={"skip_bad_lines": True})) == [data]


def test_local_files_are_checked_before_datasets_are_read(project, tmp_path, monkeypatch):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(50))
    project.root.mkdir(parents=True)
    (project.root / "extra.jsonl").write_text('{"txt": "typo"}\n', encoding="utf-8")
    read_whole: list = []
    monkeypatch.setattr(corpus_lib, "_read_sources", lambda *a: read_whole.append(1))
    with pytest.raises(CorpusError, match="extra.jsonl:1: key 'text' is missing"):
        build_corpus(project, _settings(train_prompts=10, val_prompts=5, local_prompt_files=["extra.jsonl"]),
                     _dataset(data), fingerprint="x")
    assert read_whole == [] and not project.corpus_dir.exists()


# -- too few, allow_fewer ---------------------------------------------------------------------

def test_allow_fewer_keeps_val_and_shrinks_train(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(150))
    manifest = build_corpus(project, _settings(train_prompts=300, val_prompts=50, empty_fraction=0.1,
                                               allow_fewer=True), _dataset(data), fingerprint="x")
    train, val = read_split(project, "train"), read_split(project, "val")
    assert len(val) == 50 and val.count("") == 5
    assert len([t for t in train if t]) == 150 - 45  # every remaining prompt goes to train
    assert train.count("") == empty_count(len(train), 0.1) and len(train) == manifest.splits["train"]["prompts"]
    assert manifest.requested == {"train": 300, "val": 50} and manifest.counts["unused"] == 0


def test_allow_fewer_still_fails_when_val_cannot_be_filled(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(40))
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=100, val_prompts=40, empty_fraction=0.0, allow_fewer=True),
                     _dataset(data), fingerprint="x")
    assert "40 usable prompts" in str(info.value) and "val alone needs 40" in str(info.value)


def test_too_few_error_names_allow_fewer(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(50))
    with pytest.raises(CorpusError, match="corpus.allow_fewer: true"):
        build_corpus(project, _settings(train_prompts=100, val_prompts=10), _dataset(data), fingerprint="x")


# -- manifest and UI --------------------------------------------------------------------------

def test_manifest_records_inputs_settings_outputs_and_stats(project, tmp_path):
    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(100) + _prompts(5) + ["x"])
    settings = _settings(train_prompts=60, val_prompts=20, min_chars=3)
    manifest = build_corpus(project, settings, _dataset(data), fingerprint="x")
    assert manifest.settings == settings.section_dict("corpus")
    [source] = manifest.sources
    assert source == {"source": "test/prompts", "file": str(data), "format": ".jsonl", "text_field": "text",
                      "sha256": atomic.sha256_file(data), "read": 106, "dropped_blank": 0, "dropped_length": 1,
                      "dropped_duplicate": 5, "skipped_bad_lines": 0, "kept": 100, "stamp": verify.stamp(data)}
    for split in ("train", "val"):
        assert manifest.splits[split]["sha256"] == atomic.sha256_file(project.corpus_file(split))
    assert sum(b["prompts"] for b in manifest.length_histogram) == 100
    lengths = [len(t) for t in _prompts(100)]
    assert manifest.length_chars["min"] == min(lengths) and manifest.length_chars["max"] == max(lengths)
    assert [r["split"] for r in manifest.preview] == ["train"] * 12 + ["val"] * 12
    train = read_split(project, "train")
    assert [r["text"] for r in manifest.preview[:12]] == train[:12]


def test_corpus_markdown_tables(project, tmp_path):
    from gguf_assets.defs.corpus import corpus_markdown

    data = _write_jsonl(tmp_path / "data" / "a.jsonl", _prompts(40) + ["a | pipe *and* `ticks`\nnewline"])
    manifest = build_corpus(project, _settings(train_prompts=30, val_prompts=10, empty_fraction=0.1,
                                               skip_bad_lines=True), _dataset(data), fingerprint="x")
    md = corpus_markdown(manifest)
    preview_rows = md["preview"].splitlines()[2:]
    assert len(preview_rows) == 22 and all(row.count(" | ") == 3 for row in preview_rows)
    assert "(empty: the CFG prompt)" in md["preview"] or "" not in read_split(project, "train")[:12]
    assert "| test/prompts | a.jsonl | 41 | 0 | 0 | 0 | 0 | 41 |" in md["sources"]
    assert "█" in md["length_histogram"] and "bad_lines" not in md


def test_corpus_asset_materializes_with_ui_metadata(make_project):
    import dagster as dg

    from gguf_assets.defs.corpus import corpus
    from gguf_assets.defs.materials import materials
    from gguf_assets.defs.resources import ProjectResource

    paths = make_project(corpus={"train_prompts": 300, "val_prompts": 50})
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([materials, corpus], resources={"project": ProjectResource(project_dir=str(paths.root))},
                            instance=instance)
    assert result.success
    [mat] = [m for m in result.asset_materializations_for_node("corpus")]
    meta = mat.metadata
    assert meta["train_prompts"].value == 300 and meta["count_kept"].value >= 350
    assert meta["count_dropped_duplicate"].value > 0  # the demo prompts carry deliberate duplicates
    for name in ("preview", "length_histogram", "sources"):
        assert isinstance(meta[name], dg.MarkdownMetadataValue) and meta[name].value.count("\n") >= 2
    assert len(instance.get_dynamic_partitions("train_shards")) == meta["train_shards"].value >= 1


# -- parquet --------------------------------------------------------------------------------

def _write_parquet(path: Path, columns: dict[str, list], *, row_group_size: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("text_field", ["text", "prompt"])
def test_parquet_dataset_builds_the_same_corpus_as_jsonl(tmp_path, monkeypatch, text_field):
    import pyarrow.parquet as pq

    # Duplicates, blanks and padding, across several row groups and batches.
    texts = _prompts(150) + _prompts(10) + ["   ", "  padded prompt  "]
    monkeypatch.setattr(prompt_files, "PARQUET_BATCH_ROWS", 50)
    read_columns = []
    iter_batches = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: read_columns.append(kw["columns"]) or iter_batches(self, **kw))
    settings = _settings(train_prompts=100, val_prompts=20, seed=5)
    parquet = _write_parquet(tmp_path / "pq" / "train-00000.parquet",
                             {"id": list(range(len(texts))), text_field: texts, "score": [0.5] * len(texts)})
    jsonl = _write_jsonl(tmp_path / "js" / "train.jsonl", texts, key=text_field)
    built = {}
    for name, folder in (("parquet", parquet.parent), ("jsonl", jsonl.parent)):
        paths = ProjectPaths.of(tmp_path / name)
        built[name] = build_corpus(paths, settings, _dataset(folder, text_field=text_field), fingerprint="x")
        built[name + "_files"] = [paths.corpus_file(split).read_bytes() for split in ("train", "val")]
    assert built["parquet_files"] == built["jsonl_files"]
    assert without_stamps(built["parquet"])["splits"] == without_stamps(built["jsonl"])["splits"]
    assert built["parquet"].counts == built["jsonl"].counts
    assert built["parquet"].counts["dropped_duplicate"] == 10
    source = built["parquet"].sources[0]
    assert source["format"] == ".parquet" and source["sha256"] == atomic.sha256_file(parquet)
    assert read_columns and all(columns == [text_field] for columns in read_columns)  # only the text column


def test_parquet_missing_column_lists_the_columns(project, tmp_path):
    data = _write_parquet(tmp_path / "ds" / "p.parquet", {"id": [1, 2], "question": ["a", "b"]})
    with pytest.raises(CorpusError) as info:
        build_corpus(project, _settings(train_prompts=1, val_prompts=1), _dataset(data.parent), fingerprint="x")
    message = str(info.value)
    assert f"{data}: no column 'text' (columns: 'id', 'question')" in message and "text_field" in message


def test_parquet_null_names_the_row_and_skip_bad_lines_counts_it(project, tmp_path):
    texts = _prompts(30)
    texts[7] = None
    data = _write_parquet(tmp_path / "ds" / "p.parquet", {"text": texts}, row_group_size=5)
    with pytest.raises(CorpusError) as info:
        list(read_prompt_file(data))
    assert f"{data}: row 8: column 'text' is null, not a string." in str(info.value)
    assert "corpus.skip_bad_lines" in str(info.value)
    manifest = build_corpus(project, _settings(train_prompts=20, val_prompts=5, empty_fraction=0.0,
                                               skip_bad_lines=True), _dataset(data), fingerprint="x")
    assert manifest.counts["skipped_bad_lines"] == 1 and manifest.counts["read"] == 29
    assert manifest.bad_line_samples == [f"{data}: row 8: column 'text' is null, not a string."]


def test_parquet_non_string_column_and_unreadable_files(project, tmp_path):
    numbers = _write_parquet(tmp_path / "n.parquet", {"text": [1, 2, 3]})
    with pytest.raises(CorpusError, match=rf"{numbers}: column 'text' holds int64, not strings"):
        list(read_prompt_file(numbers))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(CorpusError, match=rf"{broken}: not a readable parquet file \(.+\)\. Re-export it"):
        list(read_prompt_file(broken))
    good = _write_parquet(tmp_path / "t.parquet", {"text": _prompts(200)}).read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorpusError, match=rf"{truncated}: not a readable parquet file"):
        list(read_prompt_file(truncated))
    with pytest.raises(CorpusError, match="prompt file not found"):
        list(read_prompt_file(tmp_path / "absent.parquet"))
    zipped = tmp_path / "z.parquet.gz"
    zipped.write_bytes(gzip.compress(good))
    with pytest.raises(CorpusError, match=rf"{zipped}: a gzip-compressed parquet file.*Decompress it"):
        list(read_prompt_file(zipped))


def test_local_parquet_is_checked_cheaply_before_the_build(project, tmp_path):
    project.root.mkdir(parents=True)
    settings = _settings(local_prompt_files=["p.parquet"], text_field="prompt")
    _write_parquet(project.root / "p.parquet", {"prompt": [None] + _prompts(10)})
    with pytest.raises(CorpusError, match=r"p\.parquet: row 1: column 'prompt' is null"):
        check_prompt_files(project, settings)
    _write_parquet(project.root / "p.parquet", {"prompt": [" "] * 5})
    with pytest.raises(CorpusError, match="holds no prompts"):
        check_prompt_files(project, settings)
    _write_parquet(project.root / "p.parquet", {"prompt": _prompts(10) + [None]})
    assert check_prompt_files(project, settings) == [project.root / "p.parquet"]  # late rows: the full pass's job
