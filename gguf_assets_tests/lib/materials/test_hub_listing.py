"""How a hub repo is listed: the real huggingface_hub client against the loopback hub, its requests counted."""

import hashlib

from hub_server import _is_lfs, git_blob_id

from gguf_assets.lib.materials import hub
from gguf_assets.lib.materials.hub.child import SIBLINGS_TRUSTED_BELOW
from gguf_assets.lib.materials.hub.records import RemoteFile

# One try: a retry would double the requests counted below.
ONE_TRY = hub.HubOptions(api_timeout_s=60, stall_timeout_s=60, attempts=1, retry_wait_s=0.05, disk_reserve_bytes=0)


def _api_requests(loopback_hub) -> list[tuple[str, str]]:
    return [(r["method"], r["path"]) for r in loopback_hub.requests if r["path"].startswith("/api/")]


def test_a_listing_is_one_repo_info_call_that_brings_each_files_size_and_checksum(loopback_hub, demo_materials_root):
    """repo_info(files_metadata=True) answers the commit and every file's size, blob id and (LFS) sha256 in one
    request: no tree listing after it, for a model and a dataset."""
    for repo, kind, folder in (("demo/student", "model", demo_materials_root / "student"),
                               ("demo/prompts", "dataset", demo_materials_root / "dataset")):
        loopback_hub.requests.clear()
        listing = hub.list_repo(hub.RepoRef.parse(repo, kind=kind), options=ONE_TRY)

        assert _api_requests(loopback_hub) == [("GET", f"/api/{kind}s/{repo}/revision/main")]
        assert not [r for r in loopback_hub.requests if "/tree/" in r["path"]]
        assert listing.commit == loopback_hub.head(repo, kind=kind)
        on_disk = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert set(listing.files) == set(on_disk)
        for rel, data in on_disk.items():
            file = listing.files[rel]
            assert (file.size, file.blob_id) == (len(data), git_blob_id(data))
            # An LFS file's etag is its sha256, which the download is checked against; another's, its blob id.
            assert file.sha256 == (hashlib.sha256(data).hexdigest() if _is_lfs(rel, data) else None)
        assert kind == "dataset" or listing.files["model.safetensors"].sha256


def test_a_file_list_that_may_be_cut_short_is_taken_from_the_tree_listing(loopback_hub):
    """The hub may cut repo_info's file list short for a big repo: from SIBLINGS_TRUSTED_BELOW files on, the
    listing asks the tree listing (at the commit repo_info resolved) and has every file."""
    files = {f"shards/{i:05d}.txt": str(i).encode() for i in range(SIBLINGS_TRUSTED_BELOW)}
    commit = loopback_hub.add_repo("demo/many", files)
    loopback_hub.requests.clear()

    listing = hub.list_repo(hub.RepoRef.parse("demo/many", kind="model"), options=ONE_TRY)

    assert _api_requests(loopback_hub) == [("GET", "/api/models/demo/many/revision/main"),
                                           ("GET", f"/api/models/demo/many/tree/{commit}")]
    assert listing.commit == commit and len(listing.files) == len(files)
    assert listing.files["shards/00007.txt"] == RemoteFile("shards/00007.txt", 1, git_blob_id(b"7"))

