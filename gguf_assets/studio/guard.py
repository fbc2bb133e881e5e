"""What keeps the pages `gguf-trainer ui` serves (the studio and the Dagster UI) to their own users.

A server on 127.0.0.1 is not private: any web page the user opens can send it requests. Three doors:

- **DNS rebinding.** A page on evil.example re-points its own name at 127.0.0.1; the browser then sends
  `Host: evil.example:3001` and treats the answers as same-origin, so the page can read and change
  everything. Every request (GET, POST, WebSocket) whose Host is not a name this server is meant to be
  reached by is refused.
- **Cross-site requests.** A page of another origin may send simple POSTs (text/plain, forms) without
  asking. A request that changes something and names another Origin is refused; a WebSocket handshake
  (the Dagster UI's live GraphQL) from another Origin too. (The studio also requires JSON, which a
  cross-origin page cannot send without a CORS preflight that nothing here grants.)
- **Oversized bodies.** A body over the cap is refused with 413 as soon as its size is known, before it is
  read into memory.

Pure ASGI, no Dagster import: the studio's Starlette app and dagster-webserver's are wrapped alike.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]", "")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
STUDIO_BODY_LIMIT = 2 * 2**20  # project.yaml is a few KiB; its form values fewer
DAGSTER_UI_BODY_LIMIT = 16 * 2**20  # GraphQL queries and launch configs


def bracketed(host: str) -> str:
    """An IPv6 address as a Host header writes it: ``::1`` -> ``[::1]``."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The names a server bound to ``bind_host`` answers to: the loopback names, the bound address itself, and
    ``extra`` (`--allow-host`). Bound to every address (0.0.0.0), the machine's own names are added too; any
    other name (a LAN alias, a tunnel) must be named with --allow-host."""
    names = [*LOOPBACK_NAMES, bracketed(bind_host), *(bracketed(h.strip()) for h in extra if h.strip())]
    if bind_host in WILDCARD_BINDS:
        names += [socket.gethostname(), socket.getfqdn()]
    return tuple(dict.fromkeys(n.lower() for n in names if n))


def host_of(header: str) -> str:
    """The name in a Host or Origin authority, without its port: ``[::1]:3001`` -> ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LocalOnly:
    """ASGI middleware: the Host allow-list, the Origin check for changes and WebSockets, the body cap."""

    def __init__(self, app: ASGIApp, *, hosts: Iterable[str], body_limit: int, server: str) -> None:
        self.app, self.hosts, self.body_limit, self.server = app, tuple(hosts), body_limit, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        problem = self.refusal(scope, headers)
        if problem is not None:
            status, message = problem
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            else:
                await _answer(send, status, message)
            return
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            receive = await self._read_capped(receive)
            if receive is None:
                await _answer(send, 413, self._too_large())
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, message) when the request is refused; None when it may pass."""
        host = host_of(headers.get("host", ""))
        if host not in self.hosts:
            return 403, (f"{self.server} answers only to {', '.join(self.hosts)}, not to the host name "
                         f"{host or '(none)'!r}: another site may be trying to reach it. To open it under that "
                         "name, start `gguf-trainer ui` with --allow-host NAME.")
        origin = headers.get("origin")
        changes = scope["type"] == "websocket" or scope["method"] not in SAFE_METHODS
        if changes and origin is not None:
            authority = headers.get("host", "").lower()
            if origin.lower() not in (f"http://{authority}", f"https://{authority}"):
                return 403, (f"refused a request from {origin}: only {self.server}'s own page may change "
                             "the project")
        length = headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.body_limit):
            return 413, self._too_large()
        return None

    def _too_large(self) -> str:
        return f"a request body over {self.body_limit // 2**20} MiB is refused by {self.server}"

    async def _read_capped(self, receive: Receive) -> Receive | None:
        """The whole body read first, counted as it arrives (a chunked body names no length), and handed to the
        app in one piece; None once it passes the cap, before the rest is read."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees the same
                return _replay(message, receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.body_limit:
                return None
            more = message.get("more_body", False)
        return _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)


def _replay(first: Message, receive: Receive) -> Receive:
    sent = {"first": False}

    async def replayed() -> Message:
        if not sent["first"]:
            sent["first"] = True
            return first
        return await receive()

    return replayed


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def guarded(app: ASGIApp, *, bind_host: str, extra_hosts: Iterable[str] = (), body_limit: int,
            server: str) -> LocalOnly:
    return LocalOnly(app, hosts=allowed_hosts(bind_host, extra_hosts), body_limit=body_limit, server=server)


def wsgi_guarded(app, *, bind_host: str, extra_hosts: Iterable[str] = (), body_limit: int, server: str):
    """The same three checks for a WSGI app (TensorBoard's)."""
    guard = LocalOnly(None, hosts=allowed_hosts(bind_host, extra_hosts), body_limit=body_limit, server=server)

    def guarded_app(environ, start_response):
        headers = {"host": environ.get("HTTP_HOST", ""), **({"origin": environ["HTTP_ORIGIN"]}
                                                             if "HTTP_ORIGIN" in environ else {}),
                   **({"content-length": environ["CONTENT_LENGTH"]} if environ.get("CONTENT_LENGTH") else {})}
        problem = guard.refusal({"type": "http", "method": environ.get("REQUEST_METHOD", "GET")}, headers)
        if problem is None:
            return app(environ, start_response)
        status, message = problem
        body = json.dumps({"error": message}).encode()
        start_response(f"{status} {'Forbidden' if status == 403 else 'Content Too Large'}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return guarded_app
