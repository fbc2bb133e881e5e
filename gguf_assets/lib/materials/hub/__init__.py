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

Everything is used as ``hub.<name>`` (``from gguf_assets.lib.materials import hub``): the names below are the
package's, whichever module defines them, and all modules log as ``gguf_assets.lib.materials.hub``.
"""

import sys
import types

from gguf_assets.lib.materials.hub import api, hf_private, options, protocol, records, store, watchdog
from gguf_assets.lib.materials.hub.api import (  # noqa: F401  (the tests use them)
    _WARNED_CLEAR_TEXT,
    _fail,
    download,
    fetch_range,
    list_repo,
    warn_if_token_in_clear_text,
)
from gguf_assets.lib.materials.hub.hf_private import HF_CACHE_DIR, INCOMPLETE_SUFFIX, partial_files
from gguf_assets.lib.materials.hub.options import (
    ANSWER_TIMEOUT_ENV,
    DEFAULT_ANSWER_TIMEOUT_S,
    HF_TOKEN_ENV,
    TOKEN_ENV_VARS,
    HubOptions,
    TransferStats,
    answer_timeout_from_env,
    token_from_env,
)
from gguf_assets.lib.materials.hub.protocol import READY_FD_ENV, ChildAnswer
from gguf_assets.lib.materials.hub.records import (
    COMMIT,
    DEFAULT_ENDPOINT,
    HUB_DIR,
    RECORD_SUFFIX,
    REPO_ID,
    REPO_KINDS,
    TRANSIENT_KINDS,
    HubError,
    HubFailure,
    Listing,
    RemoteFile,
    RepoRef,
    check_disk,
    endpoint,
    finish,
    git_blob_id,
    has_partial,
    host,
    is_repo_source,
    matches_etag,
    read_record,
    record_path,
    record_selection,
    recorded_etag,
    remove_orphans,
    remove_unfinished_snapshots,
    snapshot_dir,
    still_verified,
    verified_entry,
    verify,
    write_record,
)
from gguf_assets.lib.materials.hub.store import STORE_ENV, held, to_download
from gguf_assets.lib.materials.hub.watchdog import CHILD_START_S, WAITING_NOTICE_S, Waiting

_MODULES = (records, hf_private, options, protocol, watchdog, api, store)
_UNSET = object()


class _Package(types.ModuleType):
    """Setting ``hub.<name>`` sets it where it is used, as when the package was one module: in every module that
    holds the same object under that name (a test's ``monkeypatch.setattr(hub, "matches_etag", ...)`` reaches
    ``records.verify``, and its undo puts the original back there)."""

    def __setattr__(self, name: str, value) -> None:
        current = self.__dict__.get(name, _UNSET)
        if current is not _UNSET and not isinstance(current, types.ModuleType):
            for module in _MODULES:
                if module.__dict__.get(name, _UNSET) is current:
                    setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "ANSWER_TIMEOUT_ENV", "CHILD_START_S", "COMMIT", "DEFAULT_ANSWER_TIMEOUT_S", "DEFAULT_ENDPOINT", "HF_CACHE_DIR",
    "HF_TOKEN_ENV", "HUB_DIR", "INCOMPLETE_SUFFIX", "READY_FD_ENV", "RECORD_SUFFIX", "REPO_ID", "REPO_KINDS",
    "TOKEN_ENV_VARS", "TRANSIENT_KINDS", "WAITING_NOTICE_S", "ChildAnswer", "HubError", "HubFailure", "HubOptions",
    "Listing", "RemoteFile", "RepoRef", "TransferStats", "Waiting", "answer_timeout_from_env", "check_disk",
    "download", "endpoint", "fetch_range", "finish", "git_blob_id", "has_partial", "host", "is_repo_source",
    "list_repo", "matches_etag", "partial_files", "read_record", "record_path", "record_selection", "recorded_etag",
    "remove_orphans", "remove_unfinished_snapshots", "snapshot_dir", "still_verified", "token_from_env",
    "verified_entry", "verify", "warn_if_token_in_clear_text", "write_record", "STORE_ENV", "held", "to_download",
]
