"""What a hub model and its query rows look like, without their weights: for "will it fit?" before any download.

A model repo answers with its file listing (sizes included), ``config.json`` and the safetensors index: kilobytes.
The query rows' shape comes from the header of the safetensors file that holds them, by two HTTP range reads
(its 8-byte length, then the JSON header), as ``query_rows.py`` fetches them.

Everything read is kept under ``<project>/.cache/hub/`` (``ProjectPaths.cache_dir``), by the source as it is
written (``owner/name@revision``), so ``status`` asks the hub once, not at every call. Delete the folder to read
again (a moved branch is not noticed until then; the materials step pins what it downloads on its own).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials import hub, query_rows
from gguf_assets.lib.materials.teacher import layout

CACHE_SUBDIR = "hub"
CONFIG_FILE = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"
# `status` and the studio must stay quick whatever the hub does: one try, a short bound on silence.
QUICK = dict(answer_timeout_s=8.0, api_timeout_s=8.0, stall_timeout_s=8.0, attempts=1, retry_wait_s=0.0)
# A hub that did not answer is not asked again for this long: the studio's page and `status` repeat the question.
# (A refusal, such as a gated repo, is asked again at once: the user may just have set HF_TOKEN.)
RETRY_AFTER_S = 30.0
UNANSWERED_FILE = "unanswered.json"  # the hub that last did not answer, when, and why (HubError's words)


def quick_options() -> hub.HubOptions:
    return hub.HubOptions(**QUICK)


@dataclass(frozen=True)
class HubModel:
    """A hub model's config folder (config.json and the weights index, no weights) and what its listing said."""

    source: str
    commit: str
    folder: Path
    weights_bytes: int  # the *.safetensors files at the top of the repo: what a download would fetch
    weight_files: int
    read_bytes: int  # what was fetched to know this


def _cache_root(cache_dir: Path) -> Path:
    return cache_dir / CACHE_SUBDIR


def _source_key(source: str) -> str:
    return source.replace("/", "--").replace("@", "@@")


def hub_model(cache_dir: Path, source: str, *, skip: str = "", token: str | None = None,
              options: hub.HubOptions | None = None, ask_hub: bool = True) -> HubModel:
    """``source``'s config folder, read from the hub the first time (``skip``: a file that is not weights, the
    teacher's query rows file; ``ask_hub`` False: from the cache only). Raises HubError (its one-line message
    names the repo and the fix), or UserError when ``ask_hub`` is False and nothing is cached."""
    ref = hub.RepoRef.parse(source, kind="model")
    pointer = _cache_root(cache_dir) / f"{_source_key(source)}.json"
    if pointer.is_file():
        known = atomic.read_json(pointer)
        folder = Path(known["folder"])
        if (folder / CONFIG_FILE).is_file():
            return HubModel(**{**known, "folder": folder})
    if not ask_hub:
        raise UserError("not read from the hub yet (`gguf-trainer status` or `estimate` reads it)")
    unanswered = _cache_root(cache_dir) / UNANSWERED_FILE  # per hub, not per repo: one silent hub, one wait
    last = atomic.read_json(unanswered) if unanswered.is_file() else {}
    if last.get("endpoint") == hub.endpoint() and time.time() - last["at"] < RETRY_AFTER_S:
        raise hub.HubError(hub.HubFailure.UNREACHABLE, f"{ref} ({ref.kind} repo on {hub.endpoint()}): {last['why']}")
    options = options or hub.HubOptions()
    try:
        listing = hub.list_repo(ref, token=token, options=options)
    except hub.HubError as exc:
        if exc.kind in (hub.HubFailure.UNREACHABLE, *hub.TRANSIENT_KINDS):  # a hub that did not answer, not a
            atomic.write_json(unanswered, {"endpoint": hub.endpoint(), "at": time.time(),  # refusal to fix
                                           "why": str(exc).splitlines()[0].split("): ", 1)[-1]})
        raise
    unanswered.unlink(missing_ok=True)
    folder = _cache_root(cache_dir) / ref.folder / listing.commit
    if CONFIG_FILE in listing.files:
        small = [p for p in (CONFIG_FILE, WEIGHTS_INDEX) if p in listing.files]
        hub.download(ref, listing.subset(small), folder, token=token, options=options)
        weights = [f for p, f in listing.files.items() if "/" not in p and p.endswith(WEIGHTS_SUFFIX) and p != skip]
    elif layout.is_pipeline(listing.files):
        small, weights = _pipeline_configs(ref, listing, folder, token=token, options=options)
    else:
        raise UserError(f"{source}: the repo has no config.json at {listing.commit[:12]}; point it at a transformers "
                        "model repo (config, tokenizer and *.safetensors) or an LLaDA-Image pipeline.")
    shutil.rmtree(folder / hub.HF_CACHE_DIR, ignore_errors=True)
    model = HubModel(source, listing.commit, folder, sum(f.size for f in weights), len(weights),
                     sum(listing.files[p].size for p in small))
    atomic.write_json(pointer, {**asdict(model), "folder": str(folder)})
    return model


def _pipeline_configs(ref: hub.RepoRef, listing: hub.Listing, folder: Path, *, token: str | None,
                      options: hub.HubOptions) -> tuple[list[str], list]:
    """An LLaDA-Image pipeline's sizes without its weights: the index, the parts' configs, the text encoder's weights
    index and its modeling files (kept, never run here: the estimate builds the encoder with them only under
    materials.trust_remote_code). Returns (files read, the text stack's weight files)."""
    encoder = layout.TEXT_ENCODER_DIR
    wanted = [layout.MODEL_INDEX, f"{encoder}/{CONFIG_FILE}", f"{encoder}/{WEIGHTS_INDEX}",
              *(f"{part}/{CONFIG_FILE}" for part in (layout.QUERYFORMER_DIR, layout.PROJECTION_DIR))]
    tokenizer = [p for p in listing.files if p.startswith(layout.TOKENIZER_DIR + "/")
                 and p.endswith(layout.SMALL_SUFFIXES)]  # the checks before the weights load it
    small = [p for p in wanted if p in listing.files] + sorted(tokenizer)
    hub.download(ref, listing.subset(small), folder, token=token, options=options)
    try:  # the whole code closure, so the estimate and the materials step refuse the same incomplete repo
        code = layout.remote_code_closure(
            layout.remote_code_files(layout.encoder_config(folder)), exists=lambda p: p in listing.files,
            read_text=lambda p: (folder / p).read_text(encoding="utf-8"),
            fetch=lambda paths: hub.download(ref, listing.subset(paths), folder, token=token, options=options))
    except layout.LayoutError as exc:
        raise UserError(f"{ref}: {exc}") from None
    weights = [f for p, f in listing.files.items() if p.endswith(WEIGHTS_SUFFIX)
               and p.split("/", 1)[0] in (layout.TEXT_ENCODER_DIR, layout.QUERYFORMER_DIR, layout.PROJECTION_DIR)]
    return small + code, weights


def range_headers(ref: hub.RepoRef, listing: hub.Listing, work: Path, *, token: str | None,
                  options: hub.HubOptions, served: list[int] | None = None):
    """A header_of for lib/materials/teacher/preflight.py: a hub safetensors file's header ({name: entry}) by two
    range reads (its 8-byte length, then the JSON header), checked as safetensors checks it; None for a file the
    listing does not have. ``served`` collects the bytes read."""
    import struct

    from gguf_assets.lib.core.safetensors_io import MAX_HEADER_BYTES, parse_header, safetensors_header

    def read(rel: str, start: int, end: int) -> bytes:
        out = work / f"{listing.files[rel].etag[:16]}.{start}"
        out.unlink(missing_ok=True)
        hub.fetch_range(ref, listing.commit, rel, start, end, out, token=token, options=options)
        data = out.read_bytes()
        out.unlink()
        if served is not None:
            served.append(len(data))
        return data

    def header_of(rel: str) -> dict | None:
        remote = listing.files.get(rel)
        if remote is None:
            return None
        blob = hub.held(remote)  # another project of this user fetched it: its header is on this disk
        if blob is not None:
            return safetensors_header(blob)[0]
        work.mkdir(parents=True, exist_ok=True)
        where = Path(f"{ref}:{rel}")
        # Two range reads (the length, then the header): a header's bytes and nothing of the tensors.
        prefix = read(rel, 0, 8) if remote.size >= 8 else b""
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if len(prefix) != 8 or not 2 <= n <= min(remote.size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{where}: not a safetensors file ({remote.size} bytes, header length {n})")
        raw = read(rel, 8, 8 + n)
        header, _, _ = parse_header(where, prefix, lambda _: raw, remote.size)
        return header

    return header_of


def hub_rows_shape(cache_dir: Path, source: str, file: str, tensor: str, hidden: int, *, token: str | None = None,
                   options: hub.HubOptions | None = None, ask_hub: bool = True) -> tuple[list[int], int]:
    """(shape, bytes read) of tensor ``tensor`` in ``file`` of hub repo ``source``, from the file's header alone;
    the named tensor is checked as the materials step checks it (QueryRowsError lists the candidates).
    ``ask_hub`` False: from the cache only (UserError when it is not there)."""
    ref = hub.RepoRef.parse(source, kind="model")
    pointer = _cache_root(cache_dir) / f"{_source_key(source)}.rows.json"
    key = query_rows.setting_key({"source": source, "file": file, "tensor": tensor})
    known = atomic.read_json(pointer) if pointer.is_file() else {}
    if key in known:
        return known[key]["shape"], 0
    if not ask_hub:
        raise UserError(f"{source}:{file} not read from the hub yet (`gguf-trainer status` or `estimate` reads it)")
    options = options or hub.HubOptions()
    listing = hub.list_repo(ref, token=token, options=options)
    remote = listing.files.get(file)
    if remote is None:
        raise query_rows.QueryRowsError(f"{query_rows.SETTING}.file = {file!r} is not in {ref} at "
                                        f"{listing.commit[:12]}.")
    where = f"{ref}:{file} at {listing.commit[:12]}"
    work = _cache_root(cache_dir) / "headers"
    try:
        def read(start: int, end: int, name: str) -> bytes:
            out = work / f"{remote.etag[:16]}.{name}"
            out.unlink(missing_ok=True)
            hub.fetch_range(ref, listing.commit, file, start, end, out, token=token, options=options)
            return out.read_bytes()

        n = query_rows.header_length(read(0, 8, "prefix"), file_size=remote.size, where=where)
        entries = query_rows.parse_header(read(8, 8 + n, "header"), where=where, file_size=remote.size,
                                          tensor=tensor)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shape = query_rows.check_choice(entries, tensor, hidden, where)["shape"]
    atomic.write_json(pointer, {**known, key: {"shape": shape, "commit": listing.commit}})
    return shape, 8 + n


def local_rows_shape(file: Path, tensor: str, hidden: int) -> list[int]:
    """The shape of tensor ``tensor`` in a local safetensors file, from its header (checked as the materials step
    checks it)."""
    from gguf_assets.lib.core.safetensors_io import safetensors_header

    header, _, _ = safetensors_header(file)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    return query_rows.check_choice(entries, tensor, hidden, str(file))["shape"]
