"""The hub package: what its modules share through ``hub.<name>``."""

from pathlib import Path

from hub_server import git_blob_id

from gguf_assets.lib.materials import hub
from gguf_assets.lib.materials.hub import records


def test_setting_a_name_on_the_package_sets_it_where_it_is_used(tmp_path: Path, monkeypatch):
    """``monkeypatch.setattr(hub, name, ...)`` means what it did when hub was one module: records.verify calls
    the replacement, and the undo puts the original back in records too."""
    (tmp_path / "a.txt").write_bytes(b"a")
    listing = hub.Listing("c" * 40, {"a.txt": hub.RemoteFile("a.txt", 1, git_blob_id(b"a"))})
    original, seen = records.matches_etag, []
    with monkeypatch.context() as patch:
        patch.setattr(hub, "matches_etag", lambda path, etag: seen.append(path.name) or original(path, etag))
        assert hub.verify(tmp_path, listing, {})[0] == [] and seen == ["a.txt"]
    assert records.matches_etag is original is hub.matches_etag
