"""The studio's Snapshot routes (#57) without a browser: POST /api/snapshot (the newest step, a kept step, best, and
the GGUF's eval), POST /api/snapshot/delete, the Snapshots list in /api/status, and their refusals (not JSON,
another origin, a body the page would never send, a step that is not kept, a second change while one is under way,
project.yaml that does not load). On a copy of the suite's finished project, served in this process by uvicorn
behind the studio's own guard (as `python -m gguf_assets.studio` serves it, without the seconds a new process takes
to import Dagster)."""

import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
import uvicorn
from conftest import copy_project, free_port, wait_for

from gguf_assets.lib.core import atomic
from gguf_assets.lib.output import snapshots
from gguf_assets.orchestration.instance import instance_env
from gguf_assets.studio.app import build_app
from gguf_assets.studio.guard import STUDIO_BODY_LIMIT, guarded

pytestmark = pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied


@contextlib.contextmanager
def _served(root):
    app = guarded(build_app(root), bind_host="127.0.0.1", body_limit=STUDIO_BODY_LIMIT, server="the studio")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30, what="the studio in this process")
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _call(url: str, body: dict | None = None, *, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_snapshot_evaluate_and_delete_through_the_studio_routes(finished_project, tmp_path, monkeypatch):
    paths = copy_project(finished_project[0], tmp_path / "project")
    for name, value in instance_env(paths).items():  # /api/status reads the copy's Dagster records
        monkeypatch.setenv(name, value)
    run = atomic.read_json(paths.root / "checkpoints" / "final.json")["fingerprint"]
    run_dir = paths.checkpoints_dir(run)
    with _served(paths.root) as base:
        status, view = _call(base + "/api/status")
        # No GGUF yet: a row per step a snapshot can take (the checkpoints on disk, the final step), as --list says.
        steps = "30, 35 (checkpoints), 40 (final weights)"
        assert status == 200 and view["snapshots"]["run"] == run and view["snapshots"]["steps"] == steps
        # The page's title and the state its notification follows (#65): the finished pipeline's score.
        report = atomic.read_json(paths.root / "output" / "demo-adapter.report.json")
        assert view["signal"] == {"state": "finished", "title": f"✓ {report['val_centred_cosine']:.3f} · project",
                                  "detail": report["verdict"], "run_id": view["last_run"]["run_id"]}, view["signal"]
        assert [(r["step"], r["source"], r["file"]) for r in view["snapshots"]["rows"]] == [
            (30, "checkpoint", None), (35, "checkpoint", None), (40, "final weights", None)], view["snapshots"]

        # Refused before anything is read: not JSON, another origin, a body the page would never send.
        assert _call(base + "/api/snapshot", {}, headers={"Content-Type": "text/plain"})[0] == 403
        assert _call(base + "/api/snapshot", {}, headers={"Origin": "http://evil.example"})[0] == 403
        for body, said in (({"step": "40"}, "step must be a whole number"), ({"step": True}, "step must be"),
                           ({"best": True, "step": 40}, "not both"), ({"eval": "yes"}, "true or false")):
            status, answer = _call(base + "/api/snapshot", body)
            assert status == 400 and said in answer["error"], (body, status, answer)
        # A step that is neither kept nor on disk: the library's message, for the page to show.
        status, answer = _call(base + "/api/snapshot", {"step": 7})
        assert status == 400 and answer["error"].startswith(f"step 7 is not kept: the steps a snapshot can take are "
                                                            f"{steps}. "), answer
        assert not list((paths.root / "output").glob("*-step*.gguf"))

        # Snapshot: after the end, the newest step is the final one (40 of 40); its GGUF is in the output folder.
        status, entry = _call(base + "/api/snapshot", {})
        assert status == 200, entry
        assert (entry["step"], entry["planned_steps"], entry["weights"], entry["asked"]) == (40, 40, "step40", "newest")
        gguf = paths.located(entry["file"])
        assert entry["path"] == str(gguf) and gguf.name == "demo-adapter-step40.gguf"
        assert gguf.stat().st_size == entry["bytes"] and "eval" not in entry
        rows = _call(base + "/api/status")[1]["snapshots"]["rows"]
        assert rows[2] == {"step": 40, "planned_steps": 40, "weights": "step40", "run": run,
                           "source": "kept for a snapshot", "val_centred_cosine": entry["val_centred_cosine"],
                           "eval": None, "file": str(gguf), "name": gguf.name,
                           "size": f"{entry['bytes'] / 1024:.1f} KiB", "missing": False, "same_file_as": None,
                           # The row's Copy (#65): the result's ggk command with this GGUF as the adapter.
                           "ggk_command": report["ggk_command"].replace(" output/demo-adapter.gguf ",
                                                                        f" output/{gguf.name} ")}, rows
        assert report["ggk_command"].count(" output/demo-adapter.gguf ") == 1

        # Evaluate the same step: the same file again, now with the GGUF's own score on the val shards.
        status, evaluated = _call(base + "/api/snapshot", {"step": 40, "eval": True})
        assert status == 200 and evaluated["file"] == entry["file"], evaluated
        score = evaluated["eval"]["val_centred_cosine"]
        assert 0 < score <= 1 and abs(score - entry["val_centred_cosine"]) < 0.01  # the GGUF reads back as trained
        row = _call(base + "/api/status")[1]["snapshots"]["rows"][2]
        assert row["eval"] == score and snapshots.read_snapshots(run_dir)[0]["eval"]["val_centred_cosine"] == score

        # Compare (#65): the Runs panel offers the snapshot beside the run, and compares it like one: its curve is the
        # run's to step 40 (beside the run, its point there), its scores its GGUF's evaluation.
        listed = _call(base + "/api/runs")[1]
        (name,) = [r["name"] for r in listed["runs"]]
        assert listed["compare_snapshots"] == [{"ref": gguf.name, "text": f"{gguf.name} (step 40 of {name})"}]
        status, compared = _call(f"{base}/api/runs/compare?run={run}&run={gguf.name}")
        assert status == 200 and compared["runs"] == [name, gguf.name], compared
        assert compared["svg"].count("<polyline") == 2 and compared["svg"].count("<circle") == 3  # 20, 40; 40
        of_run, of_snapshot = compared["scores"]
        assert (of_snapshot["step"], of_snapshot["gguf"], of_snapshot["final"]) == (40, score,
                                                                                    entry["val_centred_cosine"])
        assert of_snapshot["val_retrieval_top1"] == evaluated["eval"]["val_retrieval_top1"] is not None
        assert of_snapshot["snapshot"]["evaluated"] and of_run["snapshot"] is None
        status, answer = _call(f"{base}/api/runs/compare?run={run[:8]}@7")
        assert status == 400 and answer["error"].startswith(f"run {name} has no snapshot GGUF of step 7"), answer

        # One change at a time: a second one while a snapshot is under way is refused, not queued.
        entered, release = threading.Event(), threading.Event()

        def slow_snapshot(*args, **kwargs):
            entered.set()
            release.wait(60)
            return entry

        first: list = []
        with monkeypatch.context() as patched:
            patched.setattr(snapshots, "take_snapshot", slow_snapshot)
            caller = threading.Thread(target=lambda: first.append(_call(base + "/api/snapshot", {"best": True})))
            caller.start()
            try:
                assert entered.wait(60)
                status, answer = _call(base + "/api/snapshot/delete", {"step": 40})
                assert status == 409 and "wait for it" in answer["error"], answer
                assert _call(base + "/api/snapshot", {})[0] == 409
            finally:
                release.set()
                caller.join(60)
        assert first[0][0] == 200

        # Best at the last step is the run's own GGUF (a hard link). Delete on its row removes that file only (#65):
        # the plain snapshot of the same step stays; a step with two files is refused, naming both.
        status, best = _call(base + "/api/snapshot", {"best": True})
        best_gguf = paths.located(best["file"])
        assert status == 200 and best["same_file_as"] == "output/demo-adapter.gguf", best
        rows = _call(base + "/api/status")[1]["snapshots"]["rows"]
        assert [(r["weights"], r["name"], r["same_file_as"]) for r in rows[2:]] == [
            ("best", best_gguf.name, "output/demo-adapter.gguf"), ("step40", gguf.name, None)], rows
        status, answer = _call(base + "/api/snapshot/delete", {"step": 40})
        assert status == 400 and answer["error"] == (f"step 40 has 2 snapshot GGUFs: {best_gguf.name}, {gguf.name}; "
                                                     "name the file to delete"), answer
        for body in ({"file": "../demo-adapter.gguf"}, {"file": 3}, {}):
            assert _call(base + "/api/snapshot/delete", body)[0] == 400, body
        status, answer = _call(base + "/api/snapshot/delete", {"file": best_gguf.name})
        assert status == 200 and answer["deleted"] == [str(best_gguf)], answer
        assert not best_gguf.exists() and gguf.is_file() and (paths.root / "output" / "demo-adapter.gguf").is_file()

        # Delete by step, now that it has one file: the GGUF and its entry go; the kept step stays, to export again.
        status, answer = _call(base + "/api/snapshot/delete", {"step": 40})
        assert status == 200 and answer["deleted"] == [str(gguf)] and not gguf.exists(), answer
        row = _call(base + "/api/status")[1]["snapshots"]["rows"][2]
        assert (row["step"], row["source"], row["file"], row["eval"]) == (40, "kept for a snapshot", None, None)
        status, answer = _call(base + "/api/snapshot/delete", {"step": 40})
        assert status == 400 and answer["error"].startswith("no snapshot of step 40 in this run"), answer
        assert _call(base + "/api/snapshot/delete", {"step": "40"})[0] == 400

        # project.yaml that does not load: refused in one line, as Run is.
        text = paths.project_file.read_text()
        paths.project_file.write_text(text.replace("training:\n", "training:\n  stepz: 3\n", 1))
        status, answer = _call(base + "/api/snapshot", {})
        assert status == 400 and answer["error"].startswith("Snapshot is refused until project.yaml loads: "), answer
        paths.project_file.write_text(text)
    assert not gguf.exists()
