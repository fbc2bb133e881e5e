"""Reused files: the stamp check that costs no read, and the content check that rides on a read."""

import os
import shutil

import pytest

from gguf_assets.lib.core import atomic, verify


def _no_hashing(monkeypatch):
    def refuse(path, **kwargs):
        raise AssertionError(f"{path} was hashed, though its stamp is as recorded")

    monkeypatch.setattr(atomic, "sha256_file", refuse)


def _flip_keeping_stamp(path, offset):
    """One bit flipped in place, with the mtime put back: bit rot, or a tool that restores times."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_recorded_file_is_confirmed_by_its_stamp_without_reading_it(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    atomic.write_bytes(path, b"x" * 1000)
    recorded = verify.record(path)
    assert recorded["sha256"] == atomic.sha256_file(path) and recorded["bytes"] == 1000
    _no_hashing(monkeypatch)
    assert verify.confirmed(path, recorded) is recorded and verify.unchanged(path, recorded)


def test_another_size_is_a_change_without_reading(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    atomic.write_bytes(path, b"x" * 1000)
    recorded = verify.record(path)
    _no_hashing(monkeypatch)
    path.write_bytes(b"x" * 999)
    assert verify.stamp_matches(path, recorded) is False and not verify.unchanged(path, recorded)
    path.unlink()
    assert not verify.unchanged(path, recorded)


def test_an_unsure_stamp_is_settled_by_the_content_and_refreshed(tmp_path):
    path = tmp_path / "data.bin"
    atomic.write_bytes(path, b"abc" * 1000)
    recorded = verify.record(path)
    copy = tmp_path / "copy.bin"
    shutil.copy2(path, copy)  # the same bytes and mtime, another inode: a copied project
    assert verify.stamp_matches(copy, recorded) is None
    now = verify.confirmed(copy, recorded)
    assert now is not None and verify.refreshed(recorded, now) and now["inode"] == copy.stat().st_ino
    assert verify.stamp_matches(copy, now) is True

    data = bytearray(path.read_bytes())
    data[1500] ^= 0x01
    path.write_bytes(bytes(data))  # same size, new mtime, other content
    assert verify.confirmed(path, recorded) is None


def test_a_change_that_keeps_the_stamp_is_caught_by_the_reader(tmp_path):
    path = tmp_path / "data.bin"
    atomic.write_bytes(path, bytes(range(256)) * 40)
    recorded = verify.record(path)
    _flip_keeping_stamp(path, 5000)
    assert verify.stamp_matches(path, recorded) is True  # the cheap check cannot see it
    with pytest.raises(verify.CorruptFile, match=r"data.bin: its content differs from what was written.*Rebuild it"):
        verify.read_checked(path, recorded["sha256"], what_to_do="Rebuild it.")
    assert verify.read_checked(path, None, what_to_do="") == path.read_bytes()  # nothing recorded: nothing to check



def test_local_materials_reuse_a_files_hash_while_its_stamp_matches(tmp_path, monkeypatch):
    """materials.py's local-folder hash uses the same stamp rule: an untouched folder is not
    read again, an edit of the same size is, and a copy (new inodes) is hashed once, then cached."""
    from gguf_assets.lib.materials.pinning import resolve

    folder = tmp_path / "student"
    folder.mkdir()
    atomic.write_bytes(folder / "model.safetensors", b"w" * 4096)
    atomic.write_bytes(folder / "config.json", b"{}")
    commit, n_files, size, cache = resolve._hash_local_folder(folder, {})
    assert (n_files, size) == (2, 4098) and commit.startswith("local:")
    assert all(set(verify.STAMP_KEYS) <= set(entry) for entry in cache.values())

    hashed = []
    real_sha256 = atomic.sha256_file
    monkeypatch.setattr(atomic, "sha256_file", lambda path, **kw: hashed.append(path.name) or real_sha256(path, **kw))
    assert resolve._hash_local_folder(folder, cache)[0] == commit and hashed == []

    data = bytearray((folder / "model.safetensors").read_bytes())
    data[10] ^= 0xFF  # same size, new mtime: read again, and the commit follows the content
    atomic.write_bytes(folder / "model.safetensors", bytes(data))
    edited, _, _, cache = resolve._hash_local_folder(folder, cache)
    assert edited != commit and hashed == ["model.safetensors"]

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    hashed.clear()
    copied, _, _, copy_cache = resolve._hash_local_folder(copy, cache)
    assert copied == edited and sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert resolve._hash_local_folder(copy, copy_cache)[0] == edited and hashed == []


def test_the_materials_manifest_is_checked_by_stamp_and_a_copy_by_content_once(make_project, monkeypatch):
    """`status` on materials: no read while the local files' stamps match; a copied project (new
    inodes) reads them once and stores the new stamps; an edit of the same size is caught."""
    from gguf_assets.lib.materials.materials_run import manifest_is_current
    from gguf_assets.lib.materials.pinning.resolve import resolve_materials
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import load_settings

    paths = make_project(mock_teacher=True)
    settings = load_settings(paths.root)
    resolve_materials(paths, settings)
    hashed = []
    real_sha256 = atomic.sha256_file
    monkeypatch.setattr(atomic, "sha256_file", lambda path, **kw: hashed.append(path.name) or real_sha256(path, **kw))
    assert manifest_is_current(paths, settings) and hashed == []

    copy = ProjectPaths.of(paths.root.parent / "copy")
    shutil.copytree(paths.root, copy.root)  # new inodes, same mtimes
    assert manifest_is_current(copy, settings) and "model.safetensors" in hashed
    hashed.clear()
    assert manifest_is_current(copy, settings) and hashed == []  # the new stamps were kept

    weights = copy.root / "materials" / "demo" / "student" / "model.safetensors"
    _flip_keeping_stamp(weights, weights.stat().st_size - 1)  # same size and mtime: only the inode is known
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert not manifest_is_current(copy, settings)
    assert manifest_is_current(paths, settings)  # the original is untouched by its copy
