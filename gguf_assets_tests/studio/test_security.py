"""What another web page can do to the servers `gguf-trainer ui` starts, as a list a reviewer can read.

One `gguf-trainer ui` (the studio and Dagster's own webserver, through the real CLI) serves a demo project for
the whole module; every request below goes to it over a real socket. Each test is one door:

- DNS rebinding: every endpoint, GET and POST, of the studio and of the Dagster UI (HTTP and its WebSocket),
  under a Host that is not the server's own name;
- cross-origin requests with the right Host;
- content types a page may send without a preflight;
- bodies over the cap, with and without a Content-Length;
- numbers a field cannot hold, and bodies that are no JSON object;
- YAML injection through form values;
- a Save that would overwrite an edit made meanwhile (stale base, and a real race against an editor);
- the HF token, given to `ui`'s environment as a canary, in no answer and no file of the project.
"""

import hashlib
import http.client
import json
import os
import socket
import subprocess
import threading
import time

import pytest
from conftest import CLI, cli_env, free_port, new_demo_project, stop_with_ctrl_c, wait_http

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.settings import load_settings

pytestmark = [pytest.mark.slow,  # one `gguf-trainer ui` for the module (about 20 s to start on 2 cores)
              pytest.mark.xdist_group("security")]  # on one worker: the ui is started once (conftest.py)

CANARY = "hf_CANARY-canary-not-a-real-token-0123"  # distinctive, and no real token's shape
EVIL = "evil.example"
# Every studio endpoint, with a body the page itself would send.
STUDIO_GETS = ("/", "/api/status", "/api/settings", "/api/runs")
STUDIO_POSTS = ("/api/run", "/api/stop", "/api/settings", "/api/settings/form", "/api/preset", "/api/runs/use",
                "/api/runs/delete", "/api/runs/label", "/api/snapshot", "/api/snapshot/delete")
GRAPHQL_QUERY = json.dumps({"query": "{ version }"})
# What a rebinding page would send to wipe the records (the mutation need not succeed: it must not be read).
GRAPHQL_WIPE = json.dumps({"query": 'mutation { wipeAssets(assetPartitionRanges: [{assetKey: {path: ["adapter"]}}]) '
                                    "{ __typename } }"})


class Served:
    """The module's `gguf-trainer ui` and every answer it gave, for the canary check at the end."""

    def __init__(self, paths, studio_port: int, dagster_port: int, tensorboard_port: int) -> None:
        self.paths, self.studio_port, self.dagster_port = paths, studio_port, dagster_port
        self.tensorboard_port = tensorboard_port
        self.answers: list[bytes] = []

    def request(self, port: int, method: str, path: str, body: bytes | None = None, *, host: str | None = None,
                headers: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", host or f"127.0.0.1:{port}")
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            if body is not None and "Content-Length" not in (headers or {}) and \
                    "Transfer-Encoding" not in (headers or {}):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            if body is not None:
                conn.send(body)
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        self.answers.append(data)
        return answer.status, data

    def studio(self, method: str, path: str, payload: dict | None = None, **kw) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        body = json.dumps(payload).encode() if payload is not None else (b"{}" if method == "POST" else None)
        return self.request(self.studio_port, method, path, body, headers=headers, **kw)

    def settings(self) -> dict:
        return json.loads(self.studio("GET", "/api/settings")[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_materials_root):
    root = tmp_path_factory.mktemp("security")
    paths = new_demo_project(root / "project", demo_materials_root, steps=40, mock_teacher=True)
    studio_port, dagster_port, tensorboard_port = free_port(), free_port(), free_port()
    log = root / "ui.log"
    with open(log, "w") as out:
        ui = subprocess.Popen([*CLI, "ui", str(paths.root), "--port", str(dagster_port), "--studio-port",
                               str(studio_port), "--tensorboard-port", str(tensorboard_port), "--no-daemon",
                               "--no-spare-run"],  # nothing here starts a run: a spare would only take CPU
                              stdout=out, stderr=subprocess.STDOUT, env=cli_env(HF_TOKEN=CANARY),
                              start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{studio_port}/api/status", timeout=120, proc=ui)
        wait_http(f"http://127.0.0.1:{dagster_port}/server_info", timeout=180, proc=ui)
        wait_http(f"http://127.0.0.1:{tensorboard_port}/data/runs", timeout=120, proc=ui)
        yield Served(paths, studio_port, dagster_port, tensorboard_port)
    finally:
        stop_with_ctrl_c(ui, what="gguf-trainer ui")
    assert CANARY not in log.read_text()


def _pristine(served: Served) -> str:
    """The project file as the module started it (a test that changed it puts it back)."""
    return served.paths.project_file.read_text()


def test_rebinding_every_studio_endpoint_is_refused_get_included(served):
    before = _pristine(served)
    evil_host = f"{EVIL}:{served.studio_port}"
    hostile = {"values": {"materials.trust_remote_code": True}, "text": before.replace(
        "trust_remote_code: false", "trust_remote_code: true"), "name": "first look",
        "base_sha256": hashlib.sha256(before.encode()).hexdigest()}
    for path in STUDIO_GETS:
        status, body = served.studio("GET", path, host=evil_host)
        assert status == 403 and EVIL in json.loads(body)["error"], (path, status, body[:200])
        assert b"trust_remote_code" not in body and str(served.paths.root).encode() not in body
        # The same request under the server's own names is answered: the refusal is the Host's alone.
        for name in ("127.0.0.1", "localhost", "[::1]"):
            assert served.studio("GET", path, host=f"{name}:{served.studio_port}")[0] == 200, (path, name)
    for path in STUDIO_POSTS:
        # The browser thinks the page is same-origin: Origin and Host both name the rebound site.
        status, _ = served.studio("POST", path, hostile, host=evil_host, headers={"Origin": f"http://{evil_host}"})
        assert status == 403, path
    assert served.paths.project_file.read_text() == before
    assert not (served.paths.dagster_home / "studio-run.log").exists()  # no run was started


def test_rebinding_the_dagster_ui_is_refused_http_and_websocket(served):
    port = served.dagster_port
    evil_host = f"{EVIL}:{port}"
    for method, path, body in (("GET", "/", None), ("GET", "/server_info", None),
                               ("GET", "/graphql?query=%7B%20version%20%7D", None),
                               ("POST", "/graphql", GRAPHQL_QUERY.encode()),
                               ("POST", "/graphql", GRAPHQL_WIPE.encode())):
        headers = {"Content-Type": "application/json", "Origin": f"http://{evil_host}"} if body else {}
        status, answer = served.request(port, method, path, body, host=evil_host, headers=headers)
        assert status == 403 and EVIL.encode() in answer, (method, path, status, answer[:200])
        assert served.request(port, "GET", "/server_info")[0] == 200  # its own name still works
    # The UI's own page reads GraphQL under its own name.
    status, answer = served.request(port, "POST", "/graphql", GRAPHQL_QUERY.encode(),
                                    headers={"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"})
    assert status == 200 and b'"version"' in answer, answer[:300]
    # The live GraphQL WebSocket: refused under a rebound Host, and from another Origin; accepted from its own page.
    assert _websocket_upgrade(port, host=evil_host, origin=f"http://{evil_host}") != 101
    assert _websocket_upgrade(port, host=f"127.0.0.1:{port}", origin="http://evil.example") != 101
    assert _websocket_upgrade(port, host=f"127.0.0.1:{port}", origin=f"http://127.0.0.1:{port}") == 101


def test_rebinding_tensorboard_is_refused(served):
    port = served.tensorboard_port
    for path in ("/", "/data/runs", "/data/plugins_listing"):
        status, answer = served.request(port, "GET", path, host=f"{EVIL}:{port}")
        assert status == 403 and EVIL.encode() in answer, (path, status, answer[:200])
        assert served.request(port, "GET", path)[0] == 200, path


def _websocket_upgrade(port: int, *, host: str, origin: str) -> int:
    """The HTTP status of a WebSocket handshake to /graphql (101 when the socket is opened)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((f"GET /graphql HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                      f"Sec-WebSocket-Protocol: graphql-ws\r\nOrigin: {origin}\r\n\r\n").encode())
        head = sock.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1]) if head.startswith("HTTP/") else 0


def test_a_cross_origin_change_is_refused_with_the_right_host(served):
    before = _pristine(served)
    sha = served.settings()["sha256"]
    for path in STUDIO_POSTS:
        status, body = served.studio("POST", path, {"values": {"training.steps": "41"}, "base_sha256": sha},
                                     headers={"Origin": "http://evil.example"})
        assert status == 403 and b"evil.example" in body, path
    status, _ = served.request(served.dagster_port, "POST", "/graphql", GRAPHQL_WIPE.encode(),
                               headers={"Content-Type": "application/json", "Origin": "https://evil.example"})
    assert status == 403
    assert served.paths.project_file.read_text() == before


def test_content_types_a_page_can_send_without_a_preflight_are_refused(served):
    before = _pristine(served)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for path in STUDIO_POSTS:
            status, _ = served.studio("POST", path, {"values": {"training.steps": "41"}},
                                      headers={"Content-Type": content_type})
            assert status == 403, (content_type, path)
    assert served.paths.project_file.read_text() == before


def test_a_body_over_the_cap_is_refused_at_once(served):
    before = _pristine(served)
    sha = served.settings()["sha256"]
    huge = json.dumps({"text": before + "#" * (50 * 2**20), "base_sha256": sha}).encode()
    start = time.monotonic()
    try:
        status, body = served.request(served.studio_port, "POST", "/api/settings", huge,
                                      headers={"Content-Type": "application/json"})
    except (ConnectionResetError, BrokenPipeError):  # the answer came and the socket closed mid-upload
        status, body = 413, b"connection closed"
    assert status == 413 and time.monotonic() - start < 10, (status, body[:200])
    # Chunked, so no length is known up front: cut off at the cap while it arrives.
    status, _ = _chunked_post(served.studio_port, "/api/settings/form", chunks=40, chunk=2**20)
    assert status == 413
    assert served.request(served.dagster_port, "POST", "/graphql", b"x",
                          headers={"Content-Type": "application/json",
                                   "Content-Length": str(64 * 2**20)}, timeout=10)[0] == 413
    assert served.paths.project_file.read_text() == before


def _chunked_post(port: int, path: str, *, chunks: int, chunk: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        try:
            for _ in range(chunks):
                conn.send(f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n")
            conn.send(b"0\r\n\r\n")
        except (ConnectionResetError, BrokenPipeError):
            pass
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@pytest.mark.parametrize("key, value", [
    ("training.steps", "1e400"), ("training.steps", "9" * 400), ("training.steps", 9 ** 200),
    ("training.learning_rate", "9" * 400), ("training.learning_rate", "nan"), ("training.steps", {"a": 1}),
    # Over Python's 4,300-digit limit on reading an int (a ValueError inside YAML's constructor: once an HTTP 500)
    ("training.steps", "9" * 5000), ("materials.student_layer", "-" + "9" * 5000),
    ("corpus.local_prompt_files", 7)])
def test_a_number_or_value_a_field_cannot_hold_is_a_400_naming_the_field(served, key, value):
    before = _pristine(served)
    # 1e400 as a bare JSON number, as a script would send it (Python's json reads it as inf).
    payload = json.dumps({"values": {key: value}, "base_sha256": served.settings()["sha256"]})
    status, body = served.request(served.studio_port, "POST", "/api/settings/form", payload.encode(),
                                  headers={"Content-Type": "application/json"})
    error = json.loads(body)["error"]
    assert status == 400 and key in error and "project.yaml:" in error and len(error) < 600, (status, error)
    assert served.paths.project_file.read_text() == before


def test_a_body_that_is_no_json_object_is_a_400(served):
    for path in ("/api/settings", "/api/settings/form", "/api/preset"):
        for body in (b"{not json", b"[1, 2]", b'"text"', json.dumps({"values": [1], "text": 5, "name": 3}).encode()):
            status, answer = served.request(served.studio_port, "POST", path, body,
                                            headers={"Content-Type": "application/json"})
            assert status == 400 and json.loads(answer)["error"], (path, body, status, answer)


def test_form_values_cannot_inject_yaml(served):
    before = _pristine(served)
    sha = served.settings()["sha256"]
    sneaky = {"output.adapter_name": "x\nmaterials:\n  trust_remote_code: true",
              "training.device": "cpu # trust_remote_code: true",
              "corpus.local_prompt_files": "a.txt\n  trust_remote_code: true\n!!python/object/apply:os.system [id]"}
    for key, value in sneaky.items():
        status, body = served.studio("POST", "/api/settings/form", {"values": {key: value}, "base_sha256": sha})
        assert status in (200, 400), (key, status, body)
        settings = load_settings(served.paths.root)  # the file still loads, and nothing else changed
        assert settings.materials.trust_remote_code is False
        if status == 200:
            sha = json.loads(body)["sha256"]
            assert json.loads(body)["changed"] == [key.split(".", 1)[1]] or key in json.dumps(json.loads(body))
    files = load_settings(served.paths.root).corpus.local_prompt_files
    assert "!!python/object/apply:os.system [id]" in files  # kept as the text it is
    _put_back(served, before)


def _put_back(served: Served, text: str) -> None:
    status, body = served.studio("POST", "/api/settings", {"text": text, "base_sha256": served.settings()["sha256"]})
    assert status == 200, body


def test_a_save_made_on_an_older_file_is_refused_and_shows_what_changed(served):
    before = _pristine(served)
    page = served.settings()
    # The user edits project.yaml in an editor while the page is open...
    atomic.write_text(served.paths.project_file, before.replace("  steps: 40", "  steps: 44"))
    # ...then saves the form and the text editor, both built from the page's text: refused, the edit kept.
    for path, payload in (("/api/settings/form", {"values": {"training.seed": "7"}}),
                          ("/api/settings", {"text": page["text"].replace("seed: 0", "seed: 7")})):
        status, body = served.studio("POST", path, {**payload, "base_sha256": page["sha256"]})
        answer = json.loads(body)
        assert status == 409 and "changed since this page read it" in answer["error"], (path, answer)
        assert "-  steps: 40" in answer["diff"] and "+  steps: 44" in answer["diff"], answer["diff"]
        assert "steps: 44" in served.paths.project_file.read_text()
    # Without the base, a save is refused too (a page that does not say what it edited cannot be checked).
    assert served.studio("POST", "/api/settings/form", {"values": {"training.seed": "7"}})[0] == 400
    _put_back(served, before)


def test_a_save_racing_an_editor_never_loses_the_editors_edit(served):
    """The issue's race, 40 times: the studio's form Save and an editor's save of project.yaml at the same
    moment. Whichever lands first, the editor's edit is in the file afterwards."""
    before = _pristine(served)
    refused = 0
    for round_ in range(40):
        page = served.settings()
        edited = page["text"].replace("  seed: 0", f"  seed: {round_ + 1}")
        go = threading.Barrier(2)

        def editor():
            go.wait()
            time.sleep(0.002 * (round_ % 5))  # land before, during and after the studio's save
            atomic.write_text(served.paths.project_file, edited)

        thread = threading.Thread(target=editor)
        thread.start()
        go.wait()
        status, _ = served.studio("POST", "/api/settings/form", {"values": {"training.steps": str(41 + round_)},
                                                                  "base_sha256": page["sha256"]})
        thread.join()
        refused += status == 409
        assert status in (200, 409)
        assert f"  seed: {round_ + 1}" in served.paths.project_file.read_text(), round_
        atomic.write_text(served.paths.project_file, before)
    assert refused > 0  # the race was real: some saves came after the editor's


def test_the_token_reaches_no_answer_and_no_file(served):
    # The places a token could surface: the pages, the status and settings, Dagster's instance and run records.
    for path in STUDIO_GETS:
        served.studio("GET", path)
    served.request(served.dagster_port, "POST", "/graphql", json.dumps({"query": (
        "{ instance { info runLauncher { name } } runsOrError { __typename } version }")}).encode(),
        headers={"Content-Type": "application/json"})
    assert served.answers and not [a[:100] for a in served.answers if CANARY.encode() in a]
    for file in (f for f in served.paths.root.rglob("*") if f.is_file() and not f.is_symlink()):
        assert CANARY.encode() not in file.read_bytes(), file
    assert CANARY not in os.environ.get("HF_TOKEN", "")  # only `ui`'s process had it
