"""A JSON POST to a user's webhook (output.notify_url): quick, bounded, and never loud about the URL.

The URL may carry a secret (a token in its path or query, as chat and CI webhooks do), so every line that names it
shows its scheme and host only (``shown_url``). A delivery never raises: it answers the one line to log, and it
gives up after ``timeout_s`` whatever hangs (a name lookup included: the POST runs in a thread of its own that is
left behind, not waited for). Redirects are not followed: a POST that answers 3xx was not delivered.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from urllib.parse import urlsplit

SCHEMES = ("http", "https")
DEFAULT_TIMEOUT_S = 5.0


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a webhook (the settings refuse it at load), or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  a port that is not a number raises here
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in SCHEMES:
        return "must start with http:// or https://" + (f" (not {parts.scheme}:)" if parts.scheme else "")
    if not parts.hostname:
        return "names no host (e.g. https://hooks.example.com/...)"
    if any(c.isspace() for c in url):
        return "holds a space; a URL writes one as %20"
    return None


def shown_url(url: str) -> str:
    """scheme://host[:port] of ``url``: what a log line may say of it (its path and query may hold a token)."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(a URL that does not parse)"
    host = parts.hostname or "?"
    return f"{parts.scheme}://{'[' + host + ']' if ':' in host else host}{port}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # the 3xx comes back as an HTTPError
        return None


def _post(url: str, body: bytes, timeout_s: float, answer: list[str | None]) -> None:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "gguf_assets"})
    try:
        with urllib.request.build_opener(_NoRedirects()).open(request, timeout=timeout_s) as response:
            answer.append(None if 200 <= response.status < 300 else f"it answered HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        answer.append(f"it answered HTTP {exc.code} {exc.reason}".rstrip())
    except urllib.error.URLError as exc:
        answer.append(str(exc.reason))
    except (OSError, ValueError) as exc:  # a timeout while reading, a reset connection
        answer.append(str(exc) or type(exc).__name__)


def post_json(url: str, doc: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """POST ``doc`` to ``url``: None when it answered 2xx, else why not, in words that never hold the URL's path or
    query. Returns within about ``timeout_s``."""
    problem = url_problem(url)
    if problem is not None:
        return f"the URL {problem}"
    answer: list[str | None] = []
    sender = threading.Thread(target=_post, args=(url, json.dumps(doc).encode(), timeout_s, answer),
                              name="webhook", daemon=True)
    sender.start()
    sender.join(timeout_s + 0.5)
    if not answer:
        return f"no answer within {timeout_s:g} s"
    why = answer[0]
    return None if why is None else why.replace(url, shown_url(url))
