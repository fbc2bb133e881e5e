"""The public calls: list a repo at a revision, download a listing's files, read a byte range of one file.

Each runs its network work in a child process (``watchdog._run_child``), tries again what another try may mend,
and words every failure for the user (``_fail``): the repo, what happened and the fix.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gguf_assets.lib.core import faults
from gguf_assets.lib.materials.hub.options import (
    ANSWER_TIMEOUT_ENV,
    DEFAULT_ANSWER_TIMEOUT_S,
    HubOptions,
    TransferStats,
    redact,
)
from gguf_assets.lib.materials.hub.protocol import DOWNLOAD, LIST, RANGE, ChildAnswer
from gguf_assets.lib.materials.hub.records import (
    COMMIT,
    TRANSIENT_KINDS,
    HubError,
    HubFailure,
    Listing,
    RepoRef,
    endpoint,
    has_partial,
    verify,
)
from gguf_assets.lib.materials.hub.store import keep_in_store, link_from_store
from gguf_assets.lib.materials.hub.watchdog import Waiting, _run_child

log = logging.getLogger(__package__)


def _fail(ref: RepoRef, answer: ChildAnswer, *, token: str | None, attempts: int, pinned: bool) -> HubError:
    kind, detail = answer.kind or HubFailure.TRANSIENT, redact(answer.detail, token)
    where = f"{ref} ({ref.kind} repo on {endpoint()})"
    bound_s = answer.limit_s if answer.limit_s is not None else DEFAULT_ANSWER_TIMEOUT_S
    messages = {
        HubFailure.NOT_FOUND:
            f"{where}: not found. Check the id (owner/name"
            f"{', and that it is a dataset' if ref.kind == 'dataset' else ''}). If it is private, set HF_TOKEN to a "
            "token of an account that can read it.",
        HubFailure.GATED:
            f"{where} is gated and no token was given. Accept its terms on {ref.web_url}, then set HF_TOKEN to a read "
            "token of that account." if not token else
            f"{where} is gated and HF_TOKEN has no access to it. Request or accept access on {ref.web_url} with the "
            "account the token belongs to, or use a token of an account that has access.",
        HubFailure.UNAUTHORIZED:
            f"{where}: HF_TOKEN was rejected (invalid or expired). Create a new read token at "
            "https://huggingface.co/settings/tokens and set HF_TOKEN to it.",
        HubFailure.FORBIDDEN:
            f"{where}: HF_TOKEN is not allowed to read this repo. Use a token with read access to it.",
        HubFailure.REVISION:
            f"{where}: the pinned commit recorded in materials/manifest.json no longer exists upstream (the history "
            "was rewritten). Set an explicit revision (owner/name@branch-or-commit) to pin anew." if pinned else
            f"{where}: revision {ref.revision or 'main'!r} not found. Use a branch, tag or commit that exists (see "
            f"{ref.web_url}/commits/main).",
        HubFailure.ENTRY:
            f"{where}: a file the repo lists is missing on the server (404). The repo may be changing; run again "
            "later or pin another revision.",
        HubFailure.STALLED:
            f"{where}: {detail} ({attempts} tries). Check the network or proxy, then run again: finished files are "
            "kept and partial ones resume.",
        HubFailure.SILENT:
            f"{where}: {detail} ({attempts} {'try' if attempts == 1 else 'tries'}, each on a new connection). Check "
            f"that the hub at {endpoint()} works (HF_ENDPOINT chooses it; a mirror may have stalled) and that no proxy "
            "or firewall holds the connection, then run again: finished files are kept. The wait is bounded by "
            f"{ANSWER_TIMEOUT_ENV} (now {bound_s:.0f} s); raise it for a mirror that is slow to answer.",
        HubFailure.OFFLINE:
            f"{where} is not downloaded yet and HF_HUB_OFFLINE is set. Unset it for one run, or set a local folder "
            "instead of the repo id.",
        HubFailure.TRANSIENT:
            f"{where}: the download failed {attempts} times. Run again to resume. Last error: {detail}",
        HubFailure.UNREACHABLE:
            f"{where}: the hub cannot be reached ({(detail or 'no answer').splitlines()[0][:200]}). Are you offline? "
            "Set a local folder (relative to the project) instead of the repo id, or point HF_ENDPOINT at a hub mirror "
            "you can reach.",
    }
    message = messages.get(kind, f"{where}: the hub answered an error. {detail}")
    if kind not in (*TRANSIENT_KINDS, HubFailure.OFFLINE, HubFailure.UNREACHABLE) and detail:
        message += f" (hub said: {detail.splitlines()[0][:300]})"
    return HubError(kind, message)


_WARNED_CLEAR_TEXT: set[str] = set()
_LOOPBACK_HOSTS = ("localhost", "127.", "[::1]")


def warn_if_token_in_clear_text(token: str | None) -> None:
    """A token sent over plain http can be read on the way; say so (once per endpoint), and still send it."""
    url = endpoint()
    if not token or not url.startswith("http://") or url in _WARNED_CLEAR_TEXT:
        return
    host = url[len("http://"):].split("/")[0]
    if host.startswith(_LOOPBACK_HOSTS):  # it never leaves this machine
        return
    _WARNED_CLEAR_TEXT.add(url)
    log.warning("HF_ENDPOINT is %s: plain http, so your HF token is sent unencrypted and anyone on the way can read "
                "it. Use an https:// endpoint, or unset HF_TOKEN for public repos.", url)


def list_repo(ref: RepoRef, *, revision: str | None = None, token: str | None = None,
              options: HubOptions | None = None) -> Listing:
    """Resolve ``revision`` (default: the ref's, else main) to a commit and list its files."""
    options = options or HubOptions()
    revision = revision or ref.revision or "main"
    warn_if_token_in_clear_text(token)
    answer = ChildAnswer(ok=False)
    waiting = Waiting(f"listing {ref}", options.answer_timeout_s, options.attempts)
    tries = 0
    for tries in range(1, options.attempts + 1):
        answer = _run_child({"op": LIST, "repo_id": ref.repo_id, "kind": ref.kind, "revision": revision,
                             "timeout": options.api_timeout_s}, token=token, options=options, progress_dir=None,
                            waiting=waiting)
        if not answer.retryable or tries == options.attempts:  # the last try's failure is the error raised below
            break
        log.warning("%s: listing failed (try %d of %d): %s", ref, tries, options.attempts,
                    redact(answer.detail, token))
        if waiting.over():  # the hub has answered nothing for the whole bound
            break
        time.sleep(waiting.pause_s(options.retry_wait_s))
    if not answer.ok:
        raise _fail(ref, answer, token=token, attempts=tries, pinned=bool(COMMIT.match(revision)))
    return Listing(answer.commit or "", {f.path: f for f in answer.files})


def download(ref: RepoRef, listing: Listing, folder: Path, *, token: str | None = None,
             options: HubOptions | None = None, cache: dict | None = None) -> tuple[dict, TransferStats]:
    """Download the files of ``listing`` into ``folder`` by commit and verify every one of them.

    Stalls, dropped connections and files that fail verification are retried up to
    ``options.attempts`` times; a corrupted file is deleted and fetched again, never kept.
    Returns the verification cache of the files and what the transfer took. A hub that answers nothing
    at all is given up on after ``options.answer_timeout_s`` (over all the tries).
    """
    options = options or HubOptions()
    stats, started = TransferStats(), time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    bad, verified = verify(folder, listing, cache or {})
    if bad:  # what another project of this user fetched already is linked, not downloaded (store.py)
        linked = link_from_store(folder, listing.subset(bad))
        verified.update(linked)
        bad = [rel for rel in bad if rel not in linked]
    last_log = [time.monotonic()]
    total = listing.total_bytes

    def progress(current: int) -> None:
        # Only in fault-injection runs. Once a whole chunk is on disk, the kill lands mid-file: a file smaller than a
        # chunk (config.json, say) is written and renamed at once, and which of them a poll catches is chance.
        if faults.armed("download") and has_partial(folder, at_least=options.chunk_bytes):
            faults.point("download")
        if time.monotonic() - last_log[0] > 10:
            last_log[0] = time.monotonic()
            log.info("%s: %.1f of %.1f MiB on disk", ref, current / 2**20, total / 2**20)

    answer = ChildAnswer(ok=True)
    corrupt: list[str] = []
    waiting = Waiting(f"downloading {ref}", options.answer_timeout_s, options.attempts)  # .what: set per try
    while bad:
        stats.attempts += 1
        for rel in bad:  # a present but wrong file must go, or huggingface_hub would keep it
            path = folder / rel
            if path.is_file():
                path.unlink()
        log.info("%s: fetching %d file(s) at %s (try %d of %d)", ref, len(bad), listing.commit[:12],
                 stats.attempts, options.attempts)
        remote = {rel: {"etag": listing.files[rel].etag, "size": listing.files[rel].size} for rel in bad}
        waiting.what = f"downloading {len(bad)} file(s) of {ref}"
        answer = _run_child({"op": DOWNLOAD, "repo_id": ref.repo_id, "kind": ref.kind, "commit": listing.commit,
                             "local_dir": str(folder), "remote": remote, "timeout": options.api_timeout_s,
                             "read_timeout": max(1.0, options.stall_timeout_s / 2), "max_workers": options.max_workers,
                             "chunk_bytes": options.chunk_bytes},
                            token=token, options=options, progress_dir=folder, on_progress=progress,
                            waiting=waiting)
        if not answer.ok and not answer.retryable:
            raise _fail(ref, answer, token=token, attempts=stats.attempts, pinned=True)
        still_bad, newly = verify(folder, listing.subset(bad), {})
        verified.update(newly)
        stats.downloaded_bytes += sum(listing.files[rel].size for rel in newly)
        corrupt = [rel for rel in still_bad if (folder / rel).is_file()
                   and (folder / rel).stat().st_size == listing.files[rel].size]
        stats.refetched += len(corrupt)
        if corrupt:
            log.warning("%s: %s did not match the checksum the hub announced; deleted, fetching again",
                        ref, ", ".join(corrupt))
        if not answer.ok:
            log.warning("%s: try %d failed: %s", ref, stats.attempts, redact(answer.detail, token))
        bad = still_bad
        if bad and (stats.attempts >= options.attempts or waiting.over()):
            break
        if bad:
            time.sleep(waiting.pause_s(options.retry_wait_s))
    stats.seconds = time.monotonic() - started
    if bad:
        for rel in corrupt:  # never left where a later step could load it
            (folder / rel).unlink(missing_ok=True)
        if not answer.ok:
            raise _fail(ref, answer, token=token, attempts=stats.attempts, pinned=True)
        raise HubError(HubFailure.CORRUPT,
                       f"{ref}: {', '.join(bad)} arrived with a different checksum or size than the hub announced, "
                       f"{stats.attempts} times; the bad copies were deleted. Check for a proxy rewriting downloads, "
                       "or run again later.")
    keep_in_store(folder, listing, verified)
    return verified, stats


def fetch_range(ref: RepoRef, commit: str, path: str, start: int, end: int, out: Path, *,
                token: str | None = None, options: HubOptions | None = None) -> ChildAnswer:
    """Bytes [start, end) of ``path`` at ``commit`` into the file ``out`` (resumed from what it holds, tried
    again on stalls and dropped connections); returns the hub's metadata of the file: the commit it
    resolved, its etag and size. Only that range crosses the network."""
    options = options or HubOptions()
    warn_if_token_in_clear_text(token)
    waiting = Waiting(f"reading {path} of {ref}", options.answer_timeout_s, options.attempts)
    answer = ChildAnswer(ok=False)
    tries = 0
    for tries in range(1, options.attempts + 1):
        answer = _run_child({"op": RANGE, "repo_id": ref.repo_id, "kind": ref.kind, "commit": commit,
                             "path": path, "start": start, "end": end, "out": str(out),
                             "timeout": options.api_timeout_s, "read_timeout": max(1.0, options.stall_timeout_s / 2),
                             "chunk_bytes": options.chunk_bytes},
                            token=token, options=options, progress_dir=out.parent, waiting=waiting)
        have = out.stat().st_size if out.is_file() else 0
        if answer.ok and have == end - start:
            return answer
        if answer.ok:
            answer = ChildAnswer.failed(HubFailure.TRANSIENT,
                                        f"the connection closed after {have} of {end - start} bytes")
        if answer.kind == HubFailure.NO_RANGE:
            raise HubError(HubFailure.NO_RANGE, f"{ref}: {answer.detail}; the hub (HF_ENDPOINT={endpoint()}) must "
                                                "honour HTTP Range requests to fetch one tensor without the whole "
                                                "file.")
        if not answer.retryable or waiting.over():
            break
        log.warning("%s: reading bytes of %s failed (try %d of %d): %s", ref, path, tries, options.attempts,
                    redact(answer.detail, token))
        if tries < options.attempts:
            time.sleep(waiting.pause_s(options.retry_wait_s))
    raise _fail(ref, answer, token=token, attempts=tries, pinned=True)
