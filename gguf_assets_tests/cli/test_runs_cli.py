"""`gguf-trainer runs` and the studio's Runs endpoints on a real project with two real runs: the finished
reference project (conftest ``finished_project``, 40 steps), then `training.steps: 60` and a second
`gguf-trainer run`. List, diff, use the first (its GGUF's bytes come back, nothing trains), delete the
second, and the refusals, each through the real CLI or a real studio process; the studio page lists the report's
scores."""

import hashlib
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from html import unescape
from pathlib import Path

import pytest
from conftest import assert_fits_80_columns, cli, cli_env, copy_project, free_port, stop_with_ctrl_c, wait_http

from gguf_assets.lib.output.report import score_rows
from gguf_assets.lib.project.manifests import Report

pytestmark = [pytest.mark.slow,  # a `gguf-trainer run` subprocess (about 30 s), then the CLI and a studio
              pytest.mark.xdist_group("runs_cli")]  # on one worker: the two runs are made once (conftest.py)

GGUF = "output/demo-adapter.gguf"
TRAINING_LINE = re.compile(r"step \d+/\d+ loss")  # the trainer's log line at each log step


def runs_json(root: Path) -> dict:
    done = cli("runs", str(root), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def two_runs(finished_project, tmp_path_factory) -> tuple[Path, bytes]:
    """A project with two finished runs (40 then 60 steps; the second current), and the first's GGUF bytes."""
    root = copy_project(finished_project[0], tmp_path_factory.mktemp("two-runs") / "project").root
    first_gguf = (root / GGUF).read_bytes()
    text = (root / "project.yaml").read_text()
    assert text.count("  steps: 40\n") == 1
    (root / "project.yaml").write_text(text.replace("  steps: 40\n", "  steps: 60\n"))
    done = cli("run", str(root), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return root, first_gguf


@pytest.fixture
def project(two_runs, tmp_path) -> tuple[Path, bytes]:
    return copy_project(two_runs[0], tmp_path / "copy").root, two_runs[1]


def ui_stale(root: Path, monkeypatch) -> set[str]:
    """The assets the Dagster UI draws stale once the daemon's sensor has looked (as test_staleness.py reads them)."""
    import dagster as dg

    from gguf_assets.definitions import build_definitions
    from gguf_assets.pipeline.private_api import CachingStaleStatusResolver, LoadingContextForTest, StaleStatus
    from gguf_assets.pipeline.resume import resume_decision

    monkeypatch.setenv("DAGSTER_HOME", str(root / ".dagster"))
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(root))
    instance = dg.DagsterInstance.get()
    resume_decision(instance)
    resolver = CachingStaleStatusResolver(instance, build_definitions(None).resolve_asset_graph(),
                                          LoadingContextForTest(instance))
    return {name for name in ("adapter", "gguf", "eval_report")
            if resolver.get_status(dg.AssetKey(name)) == StaleStatus.STALE}


def test_list_diff_use_the_first_then_delete_the_second(project, monkeypatch):
    root, first_gguf = project
    view = runs_json(root)
    first, second = view["runs"]
    assert [(r["steps"], r["state"], r["current"]) for r in view["runs"]] == [(40, "finished", False),
                                                                              (60, "finished", True)]
    assert view["settings_run"] == second["name"] and second["made_by_settings"]
    for run in (first, second):
        assert 0 < run["final_val_centred_cosine"] <= run["best_val_centred_cosine"] + 1e-9
        assert run["gguf_val_centred_cosine"] is not None and run["disk_bytes"] > 0 and run["train_seconds"] > 0
    assert [(d["key"], d["run"], d["now"], d["result"]) for d in first["diff"]] == [("training.steps", 40, 60, True)]
    assert (root / first["kept_gguf"]).read_bytes() == first_gguf  # kept with its run when it was exported
    second_gguf = (root / GGUF).read_bytes()
    assert second_gguf != first_gguf and (root / second["kept_gguf"]).read_bytes() == second_gguf

    table = cli("runs", str(root))
    assert table.returncode == 0, table.stderr
    assert_fits_80_columns(table.stdout)  # a block per run: ten columns side by side were 237 wide
    blocks = {block.split()[0]: block for block in re.split(r"\n(?=64x1-)", table.stdout) if block.startswith("64x1-")}
    assert set(blocks) == {first["name"], second["name"]}
    assert "vs project.yaml (the run's values): training.steps=40" in blocks[first["name"]]
    assert "now: current, project.yaml" in blocks[second["name"]]
    assert "finished, 40/40 steps; best val " in blocks[first["name"]]
    diff = cli("runs", str(root), "--diff", first["fingerprint"][:8])
    assert "training.steps: 40 in the run, 60 now" in diff.stdout, diff.stdout
    assert_fits_80_columns(diff.stdout)

    before = (root / "project.yaml").read_text()
    used = cli("runs", str(root), "--use", first["name"])
    assert used.returncode == 0, used.stdout + used.stderr
    assert "project.yaml: training.steps 60 → 40" in used.stdout and f"restored: checkpoints/final.json, {GGUF}" in \
        used.stdout
    assert_fits_80_columns(used.stdout)
    assert (root / GGUF).read_bytes() == first_gguf
    # Only that key changed, in place: every comment and every other line of the file stays.
    assert (root / "project.yaml").read_text() == before.replace("  steps: 60\n", "  steps: 40\n")
    status = cli("status", str(root))
    states = [line.split()[:2] for line in status.stdout.splitlines() if line.startswith("  ")]
    assert states and all(state == "current" for _, state in states), status.stdout
    assert ui_stale(root, monkeypatch) == set()  # the Dagster UI agrees: `use` recorded what it made current
    report = json.loads((root / "output" / "demo-adapter.report.json").read_text())
    assert report["gguf_sha256"] == hashlib.sha256(first_gguf).hexdigest()
    assert report["val_centred_cosine"] == first["gguf_val_centred_cosine"]  # the first's own report, back
    again = cli("run", str(root), timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not TRAINING_LINE.search(again.stdout + again.stderr), "the run trained again"
    assert (root / GGUF).read_bytes() == first_gguf

    after = runs_json(root)
    assert [(r["name"], r["current"]) for r in after["runs"]] == [(first["name"], True), (second["name"], False)]
    refused = cli("runs", str(root), "--delete", first["name"])
    assert refused.returncode == 2 and "is the current run" in refused.stderr and "Traceback" not in refused.stderr
    assert (root / "checkpoints" / first["fingerprint"]).is_dir()
    deleted = cli("runs", str(root), "--delete", second["name"])
    assert deleted.returncode == 0, deleted.stderr
    assert re.search(rf"deleted run {second['name']}: freed \d+\.\d (KiB|MiB)", deleted.stdout), deleted.stdout
    assert not (root / "checkpoints" / second["fingerprint"]).exists()
    assert not (root / "tensorboard" / second["name"]).exists()
    assert [r["name"] for r in runs_json(root)["runs"]] == [first["name"]]
    unknown = cli("runs", str(root), "--use", second["name"])
    assert unknown.returncode == 2 and f"no run {second['name']!r}" in unknown.stderr


def _call(url: str, body: dict | None = None, *, origin: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Origin": origin} if origin else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_the_studio_runs_endpoints(project):
    root, first_gguf = project
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gguf_assets.studio", str(root), "--port", str(port),
                             "--no-spare-run"],  # the runs endpoints start no run: a spare would only take CPU
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/api/status", timeout=90, proc=proc)
        with urllib.request.urlopen(base + "/", timeout=60) as page:
            html = page.read().decode()
        assert len(re.findall(r'<section id="runs"[ >]', html)) == 1  # one section to move
        # The Evaluation panel lists every score of the report, as report.md does (lib/output/report.score_rows).
        report = Report.from_json(json.loads((root / "output" / "demo-adapter.report.json").read_text()))
        assert report.val_rel_mse is not None and report.gguf_vs_checkpoint is not None
        rows = re.findall(r"<tr><td>(.*?)</td><td class=\"num\">(.*?)</td></tr>",
                          html.split('<tbody id="evaluation">')[1].split("</tbody>")[0])
        assert [(unescape(measure), unescape(value)) for measure, value in rows] == score_rows(report)
        assert f"row {report.worst_row}: {report.worst_row_cosine:.4f}" in dict(rows).values()
        status, view = _call(base + "/api/status")  # what the page's script refreshes the table from
        assert [(r["measure"], r["value"]) for r in view["report"]["scores"]] == score_rows(report)
        status, view = _call(base + "/api/runs")
        assert status == 200 and len(view["runs"]) == 2 and len(view["settings_sha256"]) == 64
        first, second = view["runs"]
        # The Runs table's lineage column (#65): which run each continues, in the words `gguf-trainer runs` prints.
        assert "<th>lineage</th>" in html
        assert (first["lineage"], second["lineage"]) == (
            [], [f"continues {first['name']} from step 40 (training.steps raised to 60)"]), view["runs"]
        # Another origin changes nothing, and neither does a "use" made on an older project.yaml.
        use = {"run": first["name"], "base_sha256": view["settings_sha256"]}
        assert _call(base + "/api/runs/use", use, origin="http://evil.example")[0] == 403
        (root / "project.yaml").write_text((root / "project.yaml").read_text() + "# an edit made in an editor\n")
        edited = (root / "project.yaml").read_text()
        status, body = _call(base + "/api/runs/use", use)
        assert status == 409 and "changed since this page read it" in body["error"]
        assert "an edit made in an editor" in body["diff"]
        assert (root / "project.yaml").read_text() == edited and (root / GGUF).read_bytes() != first_gguf

        status, view = _call(base + "/api/runs")
        status, body = _call(base + "/api/runs/use", {**use, "base_sha256": view["settings_sha256"]})
        assert status == 200, body
        assert body["changed"] == ["training.steps 60 → 40"] and (root / GGUF).read_bytes() == first_gguf
        assert "# an edit made in an editor" in (root / "project.yaml").read_text()

        status, body = _call(base + "/api/runs/delete", {"run": first["name"]})
        assert status == 400 and "is the current run" in body["error"]
        status, body = _call(base + "/api/runs/label", {"run": second["fingerprint"], "label": "longer"})
        assert status == 200 and body["label"] == "longer"
        status, body = _call(f"{base}/api/runs/compare?run={first['name']}&run=longer")
        assert status == 200 and body["runs"] == [first["name"], second["name"]] and body["svg"].count("<polyline") == 2
        status, body = _call(base + "/api/runs/delete", {"run": "longer"})
        assert status == 200 and body["deleted"] == second["name"] and body["freed_bytes"] > 0
        assert not (root / "checkpoints" / second["fingerprint"]).exists()
        assert _call(base + "/api/runs/use", {"base_sha256": "0" * 64})[0] == 400
    finally:
        stop_with_ctrl_c(proc, what="the studio")
