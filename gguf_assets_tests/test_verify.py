"""Reused files: the stamp check that costs no read, and the content check that rides on a read."""

import os
import shutil

import pytest

from gguf_assets.lib import atomic, verify


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

