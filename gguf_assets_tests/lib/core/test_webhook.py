"""lib/core/webhook.py against a real HTTP server on 127.0.0.1 (output.notify_url, #65): a JSON POST delivered, and
every way it is not (an error answer, a redirect, a refused connection, a server that never answers) said in one
line that names no path or query of the URL, within the time allowed."""

import socket
import time

from conftest import free_port
from webhook_server import webhook_receiver

from gguf_assets.lib.core.webhook import post_json, shown_url

SECRET = "/services/T0KEN?key=s3cret"


def test_a_notice_is_posted_as_json_and_a_2xx_answer_is_delivery():
    with webhook_receiver() as hook:
        assert post_json(hook.url + SECRET, {"outcome": "finished", "score": 0.9}) is None
    assert hook.posts == [(SECRET, {"outcome": "finished", "score": 0.9})]
    assert hook.content_types == ["application/json"]


def test_an_error_answer_and_a_redirect_are_not_delivery():
    for status, said in ((500, "it answered HTTP 500 Internal Server Error"), (302, "it answered HTTP 302 Found")):
        with webhook_receiver(status) as hook:
            assert post_json(hook.url + SECRET, {"n": 1}) == said
        assert len(hook.posts) == 1  # the redirect is not followed


def test_an_unreachable_or_silent_server_is_said_in_time_and_without_the_url():
    refused = post_json(f"http://127.0.0.1:{free_port()}{SECRET}", {"n": 1})
    assert "Connection refused" in refused and "T0KEN" not in refused and "s3cret" not in refused
    with socket.socket() as silent:  # accepts the connection (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        start = time.monotonic()
        said = post_json(f"http://127.0.0.1:{silent.getsockname()[1]}{SECRET}", {"n": 1}, timeout_s=0.5)
        assert time.monotonic() - start < 2.0
    assert said in ("timed out", "no answer within 0.5 s"), said


def test_a_url_is_shown_by_scheme_and_host_only():
    assert shown_url("https://user:pw@hooks.example.com:8443/services/T0KEN?key=x") == "https://hooks.example.com:8443"
    assert shown_url("http://[::1]:9000/x") == "http://[::1]:9000"
    assert post_json("ftp://hooks.example.com/T0KEN", {}) == "the URL must start with http:// or https:// (not ftp:)"
