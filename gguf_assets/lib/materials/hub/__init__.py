"""Hugging Face hub snapshots inside the project folder: pinned, verified, resumable.

Layout under ``<project>/materials/hub/``::

    models/<owner>--<name>/<commit>/        the needed files of the repo at that commit, as in the repo
    models/<owner>--<name>/<commit>.json    the record, written last: each file's size and the sha256
                                            (LFS files) or git blob id (small files) the hub announced
    datasets/<owner>--<name>/...            the same for dataset repos

A folder is named by the commit it holds, so a moved ``main`` upstream can never change files
under a pinned folder, and a folder with a record is complete: it is reused with no network call
while its files still match the record. During a download, ``<commit>/.cache/huggingface/`` holds
huggingface_hub's ``local_dir`` metadata and the ``*.incomplete`` partial files; a killed download
resumes from them on the next run, partial files that belong to no wanted file are deleted before
it starts, and the whole ``.cache`` folder is removed once the snapshot is verified.

Every network call runs in a child process (``python -m gguf_assets.lib.materials.hub``) watched by the
caller. huggingface_hub reads its endpoint, timeouts and the implicit-token, Xet and telemetry
switches from the environment when it is imported, and its API calls have no timeout, so only a
fresh process can be configured reliably and killed when it stalls. The token goes to the child
on stdin: never in argv, the environment, a file or a log line.

The modules:

* ``records``: repo refs, listings and snapshot records; verification against the hub's checksums; disk space and
  orphaned partial files. No network.
* ``options``: ``HubOptions`` (timeouts, retries), the answer bound's environment knob, the token.
* ``protocol``: what the parent and the child spell alike: the request's ops, the signal pipe's bytes, the answer.
* ``watchdog``: the parent side: start a child, watch it, kill it when the hub stalls or stays silent.
* ``child``: the child's main (``__main__`` runs it).
* ``api``: the public calls: ``list_repo``, ``download``, ``fetch_range``.
* ``hf_private``: every use of huggingface_hub beyond its public API, each with why.
* ``store``: one store of hub files per user, hard-linked into each project's snapshot.

The rest of the product uses the package as ``hub.<name>`` (``from gguf_assets.lib.materials import hub``): it
exports what the product uses, and nothing else (test_hub_package.py checks it). The hub's own modules and the
tests import a name from the module that defines it, and a test replaces a name where it is looked up. All modules
log as ``gguf_assets.lib.materials.hub``.
"""

from gguf_assets.lib.materials.hub.api import download, fetch_range, list_repo
from gguf_assets.lib.materials.hub.hf_private import HF_CACHE_DIR
from gguf_assets.lib.materials.hub.options import HubOptions, TransferStats, token_from_env
from gguf_assets.lib.materials.hub.records import (
    COMMIT,
    HUB_DIR,
    TRANSIENT_KINDS,
    HubError,
    HubFailure,
    Listing,
    RepoRef,
    check_disk,
    endpoint,
    finish,
    is_repo_source,
    matches_etag,
    read_record,
    record_selection,
    recorded_etag,
    remove_orphans,
    remove_unfinished_snapshots,
    snapshot_dir,
    still_verified,
    verified_entry,
    verify,
)
from gguf_assets.lib.materials.hub.store import held, to_download

__all__ = [
    "COMMIT", "HF_CACHE_DIR", "HUB_DIR", "TRANSIENT_KINDS", "HubError", "HubFailure", "HubOptions", "Listing",
    "RepoRef", "TransferStats", "check_disk", "download", "endpoint", "fetch_range", "finish", "held",
    "is_repo_source", "list_repo", "matches_etag", "read_record", "record_selection", "recorded_etag",
    "remove_orphans", "remove_unfinished_snapshots", "snapshot_dir", "still_verified", "to_download",
    "token_from_env", "verified_entry", "verify",
]
