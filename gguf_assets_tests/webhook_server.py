"""A webhook receiver for the tests of output.notify_url: a real HTTP server on 127.0.0.1 in a thread of the test
process, which keeps every POST it gets (its path and its JSON) and answers each with ``status``."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Receiver:
    url: str  # http://127.0.0.1:PORT
    status: int = 204
    posts: list[tuple[str, dict]] = field(default_factory=list)  # (path with its query, the JSON body)
    content_types: list[str] = field(default_factory=list)


@contextlib.contextmanager
def webhook_receiver(status: int = 204) -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            receiver.posts.append((self.path, json.loads(body)))
            receiver.content_types.append(self.headers.get("Content-Type", ""))
            self.send_response(receiver.status)
            if 300 <= receiver.status < 400:
                self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:  # the test's output stays its own
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_port}", status)
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
