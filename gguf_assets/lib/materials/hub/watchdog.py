"""The parent side: start a child for one request, watch it through the signal pipe and the bytes on disk, and
kill it when the hub stalls (an answering hub that sends nothing more) or stays silent (no answer at all)."""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf_assets
from gguf_assets.lib.materials.hub.options import ANSWER_TIMEOUT_ENV, TOKEN_ENV_VARS, HubOptions, redact
from gguf_assets.lib.materials.hub.protocol import (
    ANSWER,
    CHILD_MODULE,
    READY,
    READY_FD_ENV,
    REQUEST,
    ChildAnswer,
    signs,
)
from gguf_assets.lib.materials.hub.records import HubFailure, host

log = logging.getLogger(__package__)

WAITING_NOTICE_S = 5.0  # a request unanswered this long gets a console line (sooner with a small bound)
CHILD_START_S = 120.0  # a child that cannot even start in this long is killed and retried


def _child_env(options: HubOptions) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV_VARS}
    package_parent = str(Path(gguf_assets.__file__).resolve().parents[1])  # the child imports this package by name
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.update({
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",  # a token in ~/.cache/huggingface is never sent
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # progress is logged by the watchdog instead
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_ETAG_TIMEOUT": str(max(1, int(options.api_timeout_s))),
        # Half the stall timeout: huggingface_hub resumes a timed-out read itself before the watchdog acts.
        "HF_HUB_DOWNLOAD_TIMEOUT": str(max(1, int(options.stall_timeout_s / 2))),
    })
    return env


@dataclass
class Waiting:
    """How long the hub has left one listing's or download's requests unanswered, over all its tries.

    The clock starts when a request goes out while none is outstanding and stops at any answer (response
    headers, or a new byte of a download): a slow hub answers, a stalled one (or a proxy holding the
    connection) does not. Each try gets a share of ``limit_s``, so a connection that hangs is replaced
    by a new one; the call gives up once the whole of it has passed without an answer.
    """

    what: str  # "listing demo/student", for the console line
    limit_s: float
    attempts: int
    since: float | None = None  # time.monotonic() of the first unanswered request; None after an answer
    told: bool = False
    start_s: float = 0.0  # how long the last try's process took to start (it counts into the silence)

    @property
    def per_try_s(self) -> float:
        return self.limit_s / max(1, self.attempts)

    @property
    def notice_s(self) -> float:
        return min(WAITING_NOTICE_S, self.limit_s / 4)

    def began(self, at: float) -> None:
        if self.since is None:
            self.since, self.told = at, False

    def heard(self) -> None:
        self.since = None

    def silent_s(self, now: float | None = None) -> float:
        return 0.0 if self.since is None else (time.monotonic() if now is None else now) - self.since

    def pause_s(self, retry_wait_s: float) -> float:
        """The wait before the next try: while the hub is silent, short enough to leave the tries their share."""
        return retry_wait_s if self.since is None else min(retry_wait_s, self.per_try_s / 4)

    def spent(self, retry_wait_s: float, now: float | None = None) -> bool:
        """Whether a next try would have too little of the bound left to be worth starting: then the try
        under way gets the rest of it, and the call gives up once it has passed."""
        left = self.limit_s - self.silent_s(now) - self.pause_s(retry_wait_s) - self.start_s
        return self.since is not None and left < self.per_try_s / 4

    def over(self) -> bool:
        """Whether the hub has now answered nothing for the whole bound."""
        return self.since is not None and self.silent_s() >= self.limit_s

    def tell(self, now: float) -> None:
        if self.told or self.silent_s(now) < self.notice_s:
            return
        self.told = True
        clock = time.strftime("%H:%M:%S", time.localtime(time.time() - self.silent_s(now)))
        log.warning("waiting for the hub at %s to answer (%.0f s, since %s): %s; it gets %.0f s in all (%s)",
                    host(), self.silent_s(now), clock, self.what, self.limit_s, ANSWER_TIMEOUT_ENV)


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:  # renamed by the downloader while we walk
            pass
    return total


def _signals(fd: int) -> bytes | None:
    """What the child said on the ready pipe since the last look; None once it closed the pipe."""
    if not select.select([fd], [], [], 0)[0]:
        return b""
    return os.read(fd, 1 << 16) or None


@dataclass
class _Watch:
    """One child's signs of life, and the verdict when it has none left.

    Two clocks: ``limit`` (the api timeout for a listing, the stall timeout for a download: no new byte)
    bounds a hub that answers slowly; ``waiting`` bounds a hub that answers nothing at all. The hub's clock
    starts when the child is ready to ask (its imports done): on a loaded machine the start alone can take
    longer than a short api timeout, and that is not the hub's silence.
    """

    options: HubOptions
    progress_dir: Path | None  # a download's folder: its bytes on disk are progress
    on_progress: Callable[[int], None] | None
    waiting: Waiting | None
    started: float  # time.monotonic() when the child was started
    ready: bool = False
    last_bytes: int = -1
    last_change: float = 0.0  # when the child became ready, or last wrote a new byte
    asked: int = 0  # requests the child sent
    answered: int = 0  # and answers it got
    quiet_since: float = 0.0  # this try's last sign of the hub: an answer, a byte, or a request after none pending

    def __post_init__(self) -> None:
        self.last_change = self.quiet_since = self.started

    @property
    def limit(self) -> float:
        return self.options.stall_timeout_s if self.progress_dir is not None else self.options.api_timeout_s

    def heed(self, said: bytes, now: float) -> None:
        """Take in what the child said on the signal pipe."""
        if READY in said and not self.ready:
            self.ready, self.last_change, self.quiet_since = True, now, now
            if self.waiting is not None:
                self.waiting.start_s = now - self.started
        for sign in signs(said):
            if sign == REQUEST:
                if self.asked == self.answered:
                    self.quiet_since = now
                self.asked += 1
            elif sign == ANSWER:
                self.answered += 1
                self._heard(now)

    def verdict(self, now: float) -> ChildAnswer | None:
        """Why the child must be killed now, as its answer; None while it may go on."""
        if not self.ready:
            if now - self.started > CHILD_START_S:
                return ChildAnswer.failed(HubFailure.TRANSIENT,
                                          f"the download process did not start within {CHILD_START_S:.0f} s")
            return None
        self._measure(now)
        if now - self.last_change > self.limit:
            what = "sent no data" if self.progress_dir is not None else "did not answer"
            return ChildAnswer.failed(HubFailure.STALLED, f"the hub {what} for {self.limit:.0f} s")
        return self._silence(now)

    def _heard(self, now: float) -> None:
        self.quiet_since = now
        if self.waiting is not None:
            self.waiting.heard()

    def _measure(self, now: float) -> None:
        """A download's bytes on disk: a new byte is the hub sending."""
        if self.progress_dir is None:
            return
        current = _bytes_under(self.progress_dir)
        if current == self.last_bytes:
            return
        if self.last_bytes >= 0:
            self._heard(now)
        self.last_bytes, self.last_change = current, now
        if self.on_progress:
            self.on_progress(current)

    def _silence(self, now: float) -> ChildAnswer | None:
        """The answer bound: a try whose share is over (when another try still has time), or the whole bound."""
        waiting = self.waiting
        if waiting is None or self.asked <= self.answered:
            return None
        waiting.began(self.quiet_since)
        waiting.tell(now)
        try_over = now - self.quiet_since >= waiting.per_try_s and not waiting.spent(self.options.retry_wait_s, now)
        if try_over or waiting.silent_s(now) >= waiting.limit_s:
            return ChildAnswer.failed(HubFailure.SILENT,
                                      f"the hub at {host()} answered nothing for {int(waiting.silent_s(now))} s",
                                      limit_s=waiting.limit_s)
        return None


def _spawn(options: HubOptions) -> tuple[subprocess.Popen, int]:
    """The child, started with the write end of the signal pipe; returns it and the read end."""
    ready_read, ready_write = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**_child_env(options), READY_FD_ENV: str(ready_write)},
                                pass_fds=(ready_write,), text=True)
    finally:
        os.close(ready_write)
    return proc, ready_read


def _supervise(proc: subprocess.Popen, ready_read: int, payload: str, watch: _Watch) -> tuple[ChildAnswer | None,
                                                                                              str, str]:
    """Hand the child its request and wait for it to end (its stdout and stderr), or kill it on the watch's
    verdict (returned first)."""
    pipe_open = True
    first, wait = True, 0.02  # short waits first: most calls end within a second
    while True:
        try:
            out, err = proc.communicate(input=payload if first else None, timeout=wait)
            return None, out, err
        except subprocess.TimeoutExpired:
            first, wait = False, min(watch.options.poll_s, wait * 2)
        now = time.monotonic()
        said = _signals(ready_read) if pipe_open else b""
        if said is None:
            pipe_open, said = False, b""
        watch.heed(said, now)
        verdict = watch.verdict(now)
        if verdict is not None:
            proc.kill()
            proc.communicate()
            return verdict, "", ""


def _read_answer(out: str, err: str, returncode: int | None, token: str | None) -> ChildAnswer:
    """The child's answer, its last stdout line; a child that ended without one died (a transient failure)."""
    for line in redact(err, token).splitlines():
        if line.strip():
            log.debug("huggingface_hub: %s", line)
    try:
        return ChildAnswer.from_json(json.loads(out.strip().splitlines()[-1]))
    except (json.JSONDecodeError, IndexError, KeyError, TypeError, ValueError, AttributeError):
        return ChildAnswer.failed(
            HubFailure.TRANSIENT, f"download process exited with code {returncode}: {redact(err, token)[-500:]}")


def _run_child(request: dict, *, token: str | None, options: HubOptions, progress_dir: Path | None,
               on_progress: Callable[[int], None] | None = None, waiting: Waiting | None = None) -> ChildAnswer:
    """Run one request in a child; kill it when it stalls or the hub stays silent (``_Watch``). Returns the
    child's answer."""
    proc, ready_read = _spawn(options)
    payload = json.dumps({**request, "token": token})
    watch = _Watch(options, progress_dir, on_progress, waiting, started=time.monotonic())
    try:
        verdict, out, err = _supervise(proc, ready_read, payload, watch)
    finally:
        os.close(ready_read)
        if proc.poll() is None:  # the run was cancelled (KeyboardInterrupt, termination): stop the download too
            proc.kill()
            proc.wait()
    return verdict if verdict is not None else _read_answer(out, err, proc.returncode, token)
