"""The per-user hub store (lib/materials/hub/store.py): files are linked, never trusted blindly, and optional."""

from __future__ import annotations

import hashlib
import os

from gguf_assets.lib.materials.hub import records, store


def _listing(files: dict[str, bytes]) -> records.Listing:
    return records.Listing("c" * 40, {p: records.RemoteFile(p, len(d), "b" * 40, hashlib.sha256(d).hexdigest())
                                      for p, d in files.items()})


def test_a_kept_file_is_linked_into_another_project_and_a_blob_changed_in_place_never_is(tmp_path, monkeypatch):
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "store"))
    files = {"text_encoder/model-00001-of-00002.safetensors": b"weights" * 1000, "config.json": b"{}"}
    listing = _listing(files)
    first = tmp_path / "first" / "snapshot"
    for rel, data in files.items():
        (first / rel).parent.mkdir(parents=True, exist_ok=True)
        (first / rel).write_bytes(data)
    assert store.link_from_store(tmp_path / "nowhere", listing) == {}  # an empty store links nothing
    _, verified = records.verify(first, listing, {})
    store.keep_in_store(first, listing, verified)

    second = tmp_path / "second" / "snapshot"
    assert store.to_download(second, listing).files == {}  # the disk check counts nothing for what it links
    linked = store.link_from_store(second, listing)
    assert sorted(linked) == sorted(files)
    rel = "text_encoder/model-00001-of-00002.safetensors"
    assert (second / rel).stat().st_ino == (first / rel).stat().st_ino  # one copy of the bytes on disk
    assert records.verify(second, listing, linked)[0] == []  # confirmed by stamp, the hub's checksum recorded

    # Deleting one project leaves the other whole.
    (first / rel).unlink()
    assert (second / rel).read_bytes() == files[rel]

    # A blob changed in place (an editor writing into a linked file) is dropped, never linked again.
    with open(second / rel, "r+b") as fh:
        fh.write(b"X")
    third = tmp_path / "third" / "snapshot"
    assert rel not in store.link_from_store(third, listing)
    assert not (third / rel).exists()

    assert sorted(store.to_download(third, listing).files) == [rel]
    monkeypatch.setenv(store.STORE_ENV, "off")
    assert store.store_root() is None and store.link_from_store(tmp_path / "fourth", listing) == {}
    assert store.to_download(tmp_path / "fourth", listing) == listing
    monkeypatch.delenv(store.STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.store_root() == tmp_path / "xdg" / "gguf_assets" / "hub-store"
    assert os.path.isdir(tmp_path / "store" / "blobs")
