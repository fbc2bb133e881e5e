"""Every use of huggingface_hub beyond its public API, in this one module, each with the reason for it.

huggingface_hub may change any of these in a minor release, so pyproject.toml bounds it to the minor release they
were read against (2.4). Before raising that bound, read each function here against the new release's source (the
file named in its docstring) and run the hub tests (gguf_assets_tests/lib/materials/test_hub*.py), which drive the
real client against a loopback hub.

The rest of the package uses only the public API: ``HfApi.repo_info``/``list_repo_tree``, ``snapshot_download``,
``get_hf_file_metadata``, ``hf_hub_url``, ``set_client_factory`` and ``huggingface_hub.utils``' ``get_session``,
``build_hf_headers`` and ``hf_raise_for_status``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# snapshot_download(local_dir=...) keeps its metadata and partial files under <local_dir>/.cache/huggingface/
# (documented); the layout below it is not.
HF_CACHE_DIR = ".cache"
INCOMPLETE_SUFFIX = ".incomplete"


def download_dir(folder: Path) -> Path:
    """Where a local_dir download keeps its partial files (huggingface_hub/_local_folder.py: the metadata folder)."""
    return folder / HF_CACHE_DIR / "huggingface" / "download"


def partial_files(folder: Path) -> list[Path]:
    """The partial files huggingface_hub is writing (or a killed download left) for ``folder``.

    Why: huggingface_hub resumes a cut connection only within one process, so a killed download (a stall the
    watchdog ended, a reboot) is resumed by continuing these files, and those no wanted file can use are deleted."""
    where = download_dir(folder)
    return list(where.rglob("*" + INCOMPLETE_SUFFIX)) if where.is_dir() else []


def partial_etag(partial: Path, wanted: set[str]) -> str | None:
    """Which of the ``wanted`` etags a partial file belongs to, from its name: huggingface_hub names it
    ``<hash>.<etag>.incomplete`` (_local_folder.py, ``incomplete_path``), and a download writes it as
    ``<hash>.<etag>.<random>.incomplete`` (file_download.py, ``_download_to_tmp_and_move``)."""
    return next((part for part in partial.name.split(".") if part in wanted), None)


def set_download_chunk_size(chunk_bytes: int) -> None:
    """The size of the pieces a download writes (``constants.DOWNLOAD_CHUNK_SIZE``, read by file_download.py at
    each read; 10 MiB, and no public setting).

    Why: the watchdog sees progress only as bytes on disk, so on a slow link 10 MiB pieces look like a stall,
    and a killed download loses the piece in flight. Only ever called in the child process, which does one request
    and exits."""
    from huggingface_hub import constants

    constants.DOWNLOAD_CHUNK_SIZE = chunk_bytes


def watch_client(on_request: Callable[[], None], on_response: Callable[[], None]) -> None:
    """Make every HTTP client huggingface_hub creates (also the one it makes anew after an SSL error) call
    ``on_request`` for each request sent and ``on_response`` for each answer's headers.

    ``set_client_factory`` is public; the default factory it replaces (``utils._http.default_client_factory``) is
    not. Why that one: it is the client huggingface_hub itself would use (its own request hook, redirects, no
    client-wide timeout), and the watchdog needs that client's requests and answers to tell a silent hub from a
    slow one."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    def client_factory():
        client = default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks,
                              "request": [*hooks.get("request", []), lambda _request: on_request()],
                              "response": [*hooks.get("response", []), lambda _response: on_response()]}
        return client

    set_client_factory(client_factory)
