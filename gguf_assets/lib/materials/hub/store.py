"""One store of hub files per user, so a 33 GB teacher is fetched once per machine, not once per project.

Layout under the store (``$GGUF_ASSETS_STORE``, else ``$XDG_CACHE_HOME/gguf_assets/hub-store``, else
``~/.cache/gguf_assets/hub-store``; ``GGUF_ASSETS_STORE=off`` turns it off)::

    blobs/<ab>/<etag>         a file's bytes, named by what the hub announced for it: the sha256 of an LFS file
                              (weights), the git blob id of a small one; so a blob is the same at every commit
    blobs/<ab>/<etag>.json    its stamp (size, mtime, inode) when it last matched that checksum

A project's snapshot (``materials/hub/...``, lib/materials/hub/__init__.py) stays what it was, a folder of real
files pinned by commit, but a file the store holds is **hard-linked** into it instead of downloaded, and every file
a project downloads is linked into the store. Why hard links, not the HF cache's symlinks or a store of paths:
- a copied project (cp -r, rsync, another machine) carries the bytes, never a link that leads outside it;
- deleting one project removes its links only: the store and every other project keep the bytes;
- a link has the blob's inode and stamp, so the record that says "verified" is checked by its stamp, for free.

A blob is untrusted until checked: its stamp against its record, else its content against its name (a blob changed
in place, by an editor writing into a linked file, is dropped, never linked). Where links cannot be made (another
filesystem, a read-only store), the project downloads as before: the store only ever saves work.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core import verify as stamps
from gguf_assets.lib.materials.hub.records import Listing, matches_etag, verified_entry

log = logging.getLogger("gguf_assets.lib.materials.hub")

STORE_ENV = "GGUF_ASSETS_STORE"
OFF = "off"


def store_root() -> Path | None:
    """The store's folder, or None when it is turned off."""
    setting = os.environ.get(STORE_ENV, "").strip()
    if setting.lower() == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "gguf_assets" / "hub-store"


def _blob(root: Path, etag: str) -> Path:
    return root / "blobs" / etag[:2] / etag


def _record(blob: Path) -> Path:
    return blob.with_name(blob.name + ".json")


def _trusted(blob: Path, etag: str) -> bool:
    """Whether ``blob`` still holds the bytes its name says: by its recorded stamp, else by its content (then the
    record is renewed); a blob that no longer matches is removed."""
    record = _record(blob)
    try:
        recorded = atomic.read_json(record) if record.is_file() else {}
    except (OSError, ValueError):
        recorded = {}
    if recorded.get("etag") == etag and stamps.stamp_matches(blob, recorded) is True:
        return True
    if blob.is_file() and matches_etag(blob, etag):
        atomic.write_json(record, verified_entry(blob, etag))
        return True
    for stale in (blob, record):
        stale.unlink(missing_ok=True)
    return False


def _link(source: Path, target: Path) -> None:
    """``target`` becomes a hard link to ``source``, atomically (a temp link renamed over it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f"{atomic.TEMP_PREFIX}{target.name}.{os.getpid()}")
    temp.unlink(missing_ok=True)
    os.link(source, temp)
    os.replace(temp, target)


def to_download(folder: Path, listing: Listing) -> Listing:
    """The files of ``listing`` the store cannot link into ``folder`` (what a download would still fetch, for the
    disk check): all of them when the store is off or on another filesystem."""
    root = store_root()
    blobs = root / "blobs" if root is not None else None
    if blobs is None or not blobs.is_dir():
        return listing
    anchor = folder
    while not anchor.exists():
        anchor = anchor.parent
    if os.stat(anchor).st_dev != os.stat(blobs).st_dev:
        return listing
    held = [rel for rel, remote in listing.files.items()
            if (blob := _blob(root, remote.etag)).is_file() and blob.stat().st_size == remote.size]
    return listing.subset([rel for rel in listing.files if rel not in held])


def held(remote) -> Path | None:
    """The store's blob of a listed file (a RemoteFile), when it holds it and still trusts it; else None. For reading
    a file's header without the network (the checks before a teacher's weights)."""
    root = store_root()
    blob = _blob(root, remote.etag) if root is not None else None
    if blob is None or not blob.is_file() or blob.stat().st_size != remote.size:
        return None
    return blob if _trusted(blob, remote.etag) else None


def link_from_store(folder: Path, listing: Listing) -> dict[str, dict]:
    """Link into ``folder`` every file of ``listing`` the store holds (and still trusts); returns their
    verification entries (hub.verify's form), which a later check confirms by stamp."""
    root = store_root()
    if root is None or not listing.files:
        return {}
    linked: dict[str, dict] = {}
    for rel, remote in sorted(listing.files.items()):
        blob = _blob(root, remote.etag)
        if not blob.is_file() or blob.stat().st_size != remote.size or not _trusted(blob, remote.etag):
            continue
        try:
            _link(blob, folder / rel)
        except OSError as exc:  # another filesystem, a read-only folder: download it instead
            log.debug("hub store: cannot link %s into %s (%s)", blob, folder, exc)
            continue
        linked[rel] = verified_entry(folder / rel, remote.etag)
    if linked:
        size = sum(listing.files[rel].size for rel in linked)
        log.info("%d file(s), %.1f MiB, linked from the hub store %s: not downloaded", len(linked), size / 2**20,
                 root)
    return linked


def keep_in_store(folder: Path, listing: Listing, verified: dict[str, dict]) -> None:
    """Link the files just downloaded and verified (``verified``: hub.verify's entries) into the store."""
    root = store_root()
    if root is None:
        return
    for rel, entry in sorted(verified.items()):
        remote = listing.files.get(rel)
        if remote is None or entry.get("etag") != remote.etag:
            continue
        blob = _blob(root, remote.etag)
        if blob.is_file() and _trusted(blob, remote.etag):
            continue
        try:
            _link(folder / rel, blob)
            atomic.write_json(_record(blob), verified_entry(blob, remote.etag))
        except OSError as exc:
            log.debug("hub store: cannot keep %s in %s (%s)", rel, root, exc)
