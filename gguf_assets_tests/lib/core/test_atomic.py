"""Tests for atomic writes of files and folders (gguf_assets.lib.core.atomic)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.atomic import TEMP_PREFIX


class Boom(RuntimeError):
    pass


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TEMP_PREFIX))


def test_write_json_round_trip(tmp_path):
    obj = {"b": [1, 2.5, None, True], "a": {"nested": "caf\u00e9"}, "n": -3}
    target = tmp_path / "deep" / "er" / "x.json"
    atomic.write_json(target, obj)
    assert atomic.read_json(target) == obj
    text = target.read_text(encoding="utf-8")
    assert text.endswith("\n") and text.index('"a"') < text.index('"b"')  # sorted keys, stable bytes
    atomic.write_json(target, {"replaced": 1})
    assert atomic.read_json(target) == {"replaced": 1}
    assert _temps(target.parent) == []


def test_write_text_and_bytes(tmp_path):
    atomic.write_text(tmp_path / "t.txt", "h\u00e9llo\n")
    assert (tmp_path / "t.txt").read_bytes() == "h\u00e9llo\n".encode("utf-8")
    atomic.write_bytes(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"


def test_atomic_path_success_replaces_the_file(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with atomic.atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(TEMP_PREFIX + "f.bin.")
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # nothing visible until the body finishes
    assert target.read_bytes() == b"new"
    assert _temps(tmp_path) == []


def test_atomic_path_failure_keeps_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic.atomic_path(target) as tmp:
            tmp.write_bytes(b"half-written")
            raise Boom()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_path_failure_without_old_file_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic.atomic_path(tmp_path / "new.bin") as tmp:
            tmp.write_bytes(b"x")
            raise Boom()
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_failure_after_body_deleted_temp(tmp_path):
    # The body may have removed/renamed the temp path itself; the original error still surfaces.
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic.atomic_path(target) as tmp:
            tmp.unlink()
            raise Boom()
    assert target.read_bytes() == b"old"


def test_file_mode_follows_umask_not_0600(tmp_path, umask_022):
    atomic.write_text(tmp_path / "a.txt", "x")
    with atomic.atomic_path(tmp_path / "b.bin") as tmp:
        tmp.write_bytes(b"y")
    assert _mode(tmp_path / "a.txt") == 0o666 & ~umask_022 == 0o644
    assert _mode(tmp_path / "b.bin") == 0o644


def test_file_mode_with_another_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic.write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.txt") == 0o640


def test_atomic_dir_creates_and_replaces_a_whole_folder(tmp_path, umask_022):
    final = tmp_path / "ckpt" / "step-00010"
    with atomic.atomic_dir(final) as tmp:
        assert tmp.name.startswith(TEMP_PREFIX + "step-00010.")
        (tmp / "weights.bin").write_bytes(b"v1")
        (tmp / "meta.json").write_text("{}")
        assert not final.exists()
    assert sorted(p.name for p in final.iterdir()) == ["meta.json", "weights.bin"]
    assert _mode(final) == 0o755
    with atomic.atomic_dir(final) as tmp:
        (tmp / "weights.bin").write_bytes(b"v2")
    assert sorted(p.name for p in final.iterdir()) == ["weights.bin"]  # replaced as a whole, not merged
    assert (final / "weights.bin").read_bytes() == b"v2"
    assert _temps(final.parent) == []


def test_atomic_dir_with_subfolders(tmp_path):
    final = tmp_path / "out"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "sub" / "deeper").mkdir(parents=True)
        (tmp / "sub" / "deeper" / "x.bin").write_bytes(b"x")
        (tmp / "top.txt").write_text("t")
    assert (final / "sub" / "deeper" / "x.bin").read_bytes() == b"x"
    assert (final / "top.txt").read_text() == "t"
    assert _temps(tmp_path) == []


def test_atomic_dir_failure_keeps_old_folder_and_no_temp(tmp_path):
    final = tmp_path / "ckpt"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "weights.bin").write_bytes(b"good")
    with pytest.raises(Boom):
        with atomic.atomic_dir(final) as tmp:
            (tmp / "weights.bin").write_bytes(b"torn")
            (tmp / "extra").write_bytes(b"e")
            raise Boom()
    assert sorted(p.name for p in final.iterdir()) == ["weights.bin"]
    assert (final / "weights.bin").read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_dir_failure_without_old_folder_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic.atomic_dir(tmp_path / "new") as tmp:
            (tmp / "a").write_bytes(b"a")
            raise Boom()
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_temps_removes_only_temp_leftovers(tmp_path):
    (tmp_path / "keep.json").write_text("{}")
    (tmp_path / "keep-dir").mkdir()
    (tmp_path / "keep-dir" / f"{TEMP_PREFIX}nested").write_text("not at the top level")
    (tmp_path / "x.tmp-notprefix").write_text("k")
    (tmp_path / f"{TEMP_PREFIX}a.json.123").write_text("stale")
    stale_dir = tmp_path / f"{TEMP_PREFIX}step-00010.abc"
    stale_dir.mkdir()
    (stale_dir / "weights.bin").write_bytes(b"w")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / f"{TEMP_PREFIX}ckpt.old").mkdir()

    assert atomic.remove_stale_temps(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "keep-dir", "keep.json", "x.tmp-notprefix"]
    assert (tmp_path / "keep-dir" / f"{TEMP_PREFIX}nested").is_file()
    assert atomic.remove_stale_temps(tmp_path) == 0


def test_remove_stale_temps_of_named_files_leaves_other_programs_temps(tmp_path):
    """The output folder may be shared: only the temps of our own files go."""
    ours = [tmp_path / f"{TEMP_PREFIX}adapter.gguf.x1y2", tmp_path / f"{TEMP_PREFIX}adapter.json.k3"]
    theirs = [tmp_path / f"{TEMP_PREFIX}adapter.gguf-other.z9", tmp_path / f"{TEMP_PREFIX}photo.png.q"]
    for path in ours + theirs:
        path.write_text("stale")
    assert atomic.remove_stale_temps(tmp_path, of=["adapter.gguf", "adapter.json"]) == 2
    assert sorted(tmp_path.iterdir()) == sorted(theirs)


def test_a_folder_set_aside_by_a_killed_replace_is_put_back(tmp_path):
    """A kill between atomic_dir's two renames leaves the old folder only under its .old name."""
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "w").write_bytes(b"v1")
    os.replace(tmp_path / "best", tmp_path / f"{TEMP_PREFIX}best{atomic.OLD_SUFFIX}")  # where the kill left it
    (tmp_path / f"{TEMP_PREFIX}best.k2j4h5g6").mkdir()  # the new one, never renamed
    (tmp_path / "final").mkdir()
    (tmp_path / f"{TEMP_PREFIX}final{atomic.OLD_SUFFIX}").mkdir()  # its successor is in place: just stale

    assert atomic.remove_stale_temps(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "final"]
    assert (tmp_path / "best" / "w").read_bytes() == b"v1"


def test_atomic_dir_puts_the_old_folder_back_when_the_new_one_cannot_take_its_place(tmp_path, monkeypatch):
    final = tmp_path / "best"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "w").write_bytes(b"v1")
    real_replace, calls = os.replace, []

    def replace_failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace_failing_second)
    with pytest.raises(OSError, match="Input/output error"), atomic.atomic_dir(final) as tmp:
        (tmp / "w").write_bytes(b"v2")
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert (final / "w").read_bytes() == b"v1" and sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_remove_stale_temps_on_missing_folder(tmp_path):
    assert atomic.remove_stale_temps(tmp_path / "absent") == 0


def test_sha256_file_and_fingerprint(tmp_path):
    import hashlib

    data = os.urandom(3000)
    (tmp_path / "d").write_bytes(data)
    assert atomic.sha256_file(tmp_path / "d", chunk_bytes=1000) == hashlib.sha256(data).hexdigest()
    assert atomic.fingerprint({"a": 1, "b": [2]}) == atomic.fingerprint({"b": [2], "a": 1})
    assert atomic.fingerprint({"a": 1}) != atomic.fingerprint({"a": 2})
    assert len(atomic.fingerprint({})) == 16


@pytest.fixture
def full_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs), where the libraries' own writers run out of space."""
    import subprocess

    mount = tmp_path / "small disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.decode().strip()}); "
                    "test_faults.py covers a full disk by fault injection")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_libraries_running_out_of_disk_give_the_documented_message(full_disk):
    """safetensors (SafetensorError) and gguf (a short write with no errno) each report a full disk
    their own way; both become the one message, and no torn file is left."""
    import errno

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file

    def write_safetensors(tmp):
        save_file({"a": torch.zeros(200_000)}, str(tmp))

    def write_gguf(tmp):
        writer = gguf.GGUFWriter(str(tmp), "test")
        writer.add_tensor("t", np.zeros(200_000, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    for name, write in (("shard.safetensors", write_safetensors), ("adapter.gguf", write_gguf)):
        final = full_disk / name
        with pytest.raises(OSError) as failed, atomic.atomic_path(final) as tmp:
            write(tmp)
        assert failed.value.errno == errno.ENOSPC
        message = str(failed.value)
        assert f"No space left on device while writing {final}" in message and "MiB free there" in message
        assert "Free space on that disk and run again" in message
        assert list(full_disk.iterdir()) == [], "a torn temp file was left"
