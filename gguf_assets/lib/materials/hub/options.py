"""What the caller sets: the timeouts and retry bounds (``HubOptions``), the answer bound's environment knob and
the token, read from the environment at each call."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gguf_assets.lib.materials.hub.records import HubError, HubFailure

HF_TOKEN_ENV = "HF_TOKEN"  # the only place the HF token is read from (token_from_env); never stored or shown
# Variables whose value could make the child send a token other than the one handed to it.
TOKEN_ENV_VARS = (HF_TOKEN_ENV, "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")
# How long a hub (or mirror, or the proxy in between) may leave the requests unanswered, over all the
# tries of one listing or download, before the run gives up; an answering but slow hub is bound by the
# api and stall timeouts instead. The user's knob, named in the messages.
ANSWER_TIMEOUT_ENV = "GGUF_ASSETS_HUB_ANSWER_TIMEOUT_S"
DEFAULT_ANSWER_TIMEOUT_S = 90.0


def answer_timeout_from_env() -> float:
    """GGUF_ASSETS_HUB_ANSWER_TIMEOUT_S, or the default; a value that is no positive number is the user's to fix."""
    raw = os.environ.get(ANSWER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_ANSWER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise HubError(HubFailure.SETTING,
                       f"{ANSWER_TIMEOUT_ENV}={raw!r} is not a number of seconds above 0: how long to wait for a hub "
                       f"that answers nothing. Unset it (default {DEFAULT_ANSWER_TIMEOUT_S:.0f}) or set it to, for "
                       "example, 300.")
    return value


@dataclass(frozen=True)
class HubOptions:
    """Timeouts and retry bounds; tests shrink them, the defaults suit a slow home connection."""

    # A hub that answers nothing at all (no response to a request), over all the tries of one call: the
    # call gives up after this long. Each try waits a share of it (the tries: ``attempts``).
    answer_timeout_s: float = field(default_factory=answer_timeout_from_env)
    api_timeout_s: float = 120.0  # a listing call that takes longer is killed and retried
    stall_timeout_s: float = 120.0  # a download with no new byte for this long is killed and retried
    attempts: int = 4  # tries per phase (stalls, dropped connections, 5xx, corrupted files)
    retry_wait_s: float = 3.0
    disk_reserve_bytes: int = 512 << 20  # left free after a download
    max_workers: int = 4
    poll_s: float = 0.25
    # huggingface_hub writes 10 MiB chunks; smaller ones let the watchdog see progress on a slow
    # link and let a killed download keep more of what it received.
    chunk_bytes: int = 256 << 10


@dataclass
class TransferStats:
    downloaded_bytes: int = 0
    attempts: int = 0
    refetched: int = 0
    seconds: float = 0.0


def token_from_env() -> str | None:
    """The HF token the hub calls send: HF_TOKEN as it is now (read at each call, in the process that calls, so
    a process that runs several pipelines sees it as it is at each run), or None."""
    return os.environ.get(HF_TOKEN_ENV) or None


def redact(text: str, token: str | None) -> str:
    return text.replace(token, "<HF_TOKEN>") if token else text
