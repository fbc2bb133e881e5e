"""Training runs as lib/runs/ reads them from disk: names, states, scores, the settings diff, labels,
deletion and the overlay, on copies of one real finished project (conftest ``finished_project``) and on run
folders made from its own, plus one real training session stopped part way."""

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from conftest import assert_fits_80_columns, cli, copy_project, unwrapped

from gguf_assets.lib.core import atomic, metrics
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import FINAL_DIR, KEPT_DIR, LABEL_FILE, META_FILE, SESSION_FILE, ProjectPaths
from gguf_assets.lib.project.settings import load_settings, replace
from gguf_assets.lib.runs import changes, compare, listing
from gguf_assets.lib.runs.listing import RunsError, RunState
from gguf_assets.lib.status.states import State, project_status
from gguf_assets.lib.telemetry.curves_log import run_name
from gguf_assets.lib.telemetry.render import RUN_COLOURS
from gguf_assets.lib.training.training_run import SESSION_RUNNING, write_session

OTHER = "0123456789abcdef"  # a second run's folder: the finished run's checkpoints under another fingerprint


@pytest.fixture
def project(finished_project, tmp_path) -> ProjectPaths:
    return copy_project(finished_project[0], tmp_path / "copy")


def only_run(paths: ProjectPaths) -> listing.Run:
    view = listing.list_runs(paths, load_settings(paths.root))
    assert len(view.runs) == 1, view.runs
    return view.runs[0]


def second_run(paths: ProjectPaths, *, finished: bool) -> ProjectPaths:
    """checkpoints/OTHER: a copy of the finished run's folder (without final/ and export/ when not finished)."""
    first = only_run(paths).fingerprint
    shutil.copytree(paths.checkpoints_dir(first), paths.checkpoints_dir(OTHER))
    if not finished:
        shutil.rmtree(paths.checkpoints_dir(OTHER) / FINAL_DIR)
        shutil.rmtree(paths.checkpoints_dir(OTHER) / KEPT_DIR)
    return paths


def test_a_finished_run_is_named_scored_kept_and_current(project):
    settings = load_settings(project.root)
    run = only_run(project)
    final = atomic.read_json(project.checkpoints_dir(run.fingerprint) / FINAL_DIR / META_FILE)
    assert run.name == run_name(settings.training, run.fingerprint) == f"64x1-40steps-lr0.006-{run.fingerprint[:8]}"
    assert (run.state, run.step, run.steps, run.detail) == (RunState.FINISHED, 40, 40, "")
    # 40 steps of ggk's resampler on the demo pair: well above where it started, not yet good.
    assert run.final_val_centred_cosine == final["val_centred_cosine"] > final["untrained_val_centred_cosine"] + 0.05
    assert (run.best_step, run.best_val_centred_cosine) == (final["best"]["step"], final["best"]["val_centred_cosine"])
    report = atomic.read_json(project.report_json(settings))
    assert run.gguf_val_centred_cosine == report["val_centred_cosine"]
    assert run.gguf_retrieval == {key: report[key] for key in metrics.RETRIEVAL_KEYS}  # its GGUF's prompt retrieval
    assert report[metrics.VAL_RETRIEVAL_PROMPTS] > 0 and report[metrics.VAL_RETRIEVAL_TOP1] is not None
    assert run.current and run.made_by_settings and run.diff == []
    # Training recorded its wall time and its settings; the export and report were kept with the run.
    assert not run.seconds_estimated and 0 < run.train_seconds < 600
    assert settings_history.recall(project.root, run.settings_hash) == settings and run.settings_source == "its report"
    assert (project.root / run.kept_gguf).read_bytes() == (project.root / "output" / "demo-adapter.gguf").read_bytes()
    assert run.kept_report
    assert run.curve[0][0] == 0 and run.curve[-1] == (40, pytest.approx(final["val_centred_cosine"]))
    # Its last validation's scores (step 40), as its history holds them.
    last = next(e for e in reversed(final["history"]) if "val_centred_cosine" in e)
    assert run.last_scores == {"step": 40, **{k: last[k] for k in listing.LAST_SCORE_KEYS}}
    # The torch weights at step 40 are the GGUF's: its report's scores (numpy, f16 matrices) are the same.
    assert run.last_scores["val_rel_mse"] == pytest.approx(report["val_rel_mse"], rel=1e-3)
    assert run.last_scores["worst_row"] == report["worst_row"] in range(final["shape"]["query_rows"])
    # The disk its folder and its TensorBoard events take, as du counts it (du adds each folder's own block).
    folders = [project.checkpoints_dir(run.fingerprint), project.root / "tensorboard" / run.name]
    du = subprocess.run(["du", "-skc", *map(str, folders)], capture_output=True, text=True, check=True)
    total = int(du.stdout.splitlines()[-1].split()[0]) * 1024
    assert total - 128 * 1024 <= run.disk_bytes <= total
    assert not (project.checkpoints_dir(run.fingerprint) / SESSION_FILE).exists()  # finished: nothing to tell


def test_the_settings_diff_says_which_keys_change_a_result(project):
    now = load_settings(project.root)
    earlier = replace(now, training={"steps": 10, "log_every": 3, "device": "cuda"},
                      output={"ggk_command": "ggk x", "notify_url": "https://hooks.example.com/services/T0KEN"})
    diff = {d.key: d for d in listing.settings_diff(earlier, now)}
    assert set(diff) == {"training.steps", "training.log_every", "training.device", "output.ggk_command",
                         "output.notify_url"}
    assert (diff["training.steps"].run, diff["training.steps"].now) == (10, 40)
    assert diff["training.steps"].result and diff["output.ggk_command"].result
    assert not diff["training.log_every"].result and not diff["training.device"].result
    assert diff["training.log_every"].text().endswith("(changes no result)")
    # A webhook's URL may hold a token: `runs --diff` names it by scheme and host (#65).
    assert not diff["output.notify_url"].result
    assert diff["output.notify_url"].text().startswith("output.notify_url: https://hooks.example.com in the run, ")
    assert "T0KEN" not in diff["output.notify_url"].text()
    assert listing.settings_diff(now, now) == []


def test_how_a_run_ended_is_one_vocabulary_in_the_words_users_read(tmp_path):
    """The session record, the Runs list and the studio's last-run line share training_run.RunOutcome: its
    values are the words session.json, `gguf-trainer runs` and the page have always shown."""
    from gguf_assets.lib.training import training_run
    from gguf_assets.studio import last_run

    assert RunState is training_run.RunOutcome and last_run.RunOutcome is training_run.RunOutcome
    assert [str(s) for s in RunState] == ["finished", "running", "stopped", "failed", "partial"]
    assert (training_run.SESSION_RUNNING, training_run.SESSION_STOPPED, training_run.SESSION_FAILED) == (
        RunState.RUNNING, RunState.STOPPED, RunState.FAILED)
    write_session(tmp_path, SESSION_RUNNING, step=3)
    assert json.loads((tmp_path / SESSION_FILE).read_text())["state"] == "running"
    assert json.dumps({"state": RunState.FINISHED}) == '{"state": "finished"}' and f"{RunState.PARTIAL}" == "partial"


def test_a_run_s_state_comes_from_its_checkpoints_and_its_last_session(project):
    second_run(project, finished=False)
    run_dir = project.checkpoints_dir(OTHER)

    def state() -> listing.Run:
        view = listing.list_runs(project, load_settings(project.root))
        return next(r for r in view.runs if r.fingerprint == OTHER)

    run = state()  # no session record (a run from before they were kept): partial, at its newest checkpoint
    assert (run.state, run.step, run.current, run.made_by_settings) == (RunState.PARTIAL, 40, False, False)
    assert run.name.endswith(OTHER[:8]) and "trained to step 40 of 40" in run.detail
    assert run.final_val_centred_cosine is None and run.best_val_centred_cosine is not None

    write_session(run_dir, SESSION_RUNNING, step=40)  # this process: alive
    assert state().state == RunState.RUNNING and f"pid {os.getpid()}" in state().detail
    gone = subprocess.Popen(["true"])
    gone.wait()
    session = atomic.read_json(run_dir / SESSION_FILE)
    atomic.write_json(run_dir / SESSION_FILE, {**session, "pid": gone.pid, "pid_started": "1.00"})
    run = state()  # a kill -9 or a reboot leaves "running" behind a dead process
    assert run.state == RunState.PARTIAL and "cut off at step 40" in run.detail
    atomic.write_json(run_dir / SESSION_FILE, {**session, "state": "failed", "step": 35,
                                               "message": "step 36: the loss is nan; lower the learning rate"})
    run = state()
    assert run.state == RunState.FAILED and "the loss is nan" in run.detail and "step 35" in run.detail
    atomic.write_json(run_dir / SESSION_FILE, {**session, "state": "stopped", "message": "stopped at step 40 of 40"})
    assert state().state == RunState.STOPPED


def test_the_trainer_records_a_stopped_session_its_settings_and_its_time(project):
    """A real training session (the finished project's shards, 60 steps) paused after 5 steps."""
    from gguf_assets.lib.materials.materials_run import load_manifest
    from gguf_assets.lib.precompute.shards_run import require_current
    from gguf_assets.lib.training.train import train_adapter
    from gguf_assets.lib.training.training_run import adapter_fingerprint

    longer = replace(load_settings(project.root), training={"steps": 60})
    materials = load_manifest(project)
    folders = {split: require_current(project, longer, materials, split) for split in ("train", "val")}
    fingerprint = adapter_fingerprint(project, longer, materials)
    result = train_adapter(project, longer, train_folders=folders["train"], val_folders=folders["val"],
                           fingerprint=fingerprint, stop_after=5)
    assert not result.finished and result.step == 5
    session = atomic.read_json(project.checkpoints_dir(fingerprint) / SESSION_FILE)
    assert (session["state"], session["step"]) == ("stopped", 5)
    view = listing.list_runs(project, load_settings(project.root))
    run = next(r for r in view.runs if r.fingerprint == fingerprint)
    assert (run.state, run.step, run.steps) == (RunState.STOPPED, 5, 60)
    assert run.name == f"64x1-60steps-lr0.006-{fingerprint[:8]}" and not run.current and not run.made_by_settings
    assert settings_history.recall(project.root, run.settings_hash) == longer and run.settings_source == "its training"
    assert [(d.key, d.run, d.now) for d in run.diff] == [("training.steps", 60, 40)]
    assert not run.seconds_estimated and run.train_seconds > 0
    assert view.runs[-1].fingerprint == fingerprint  # oldest first


def test_runs_are_found_by_name_fingerprint_start_or_label_and_refused_clearly(project):
    second_run(project, finished=True)
    view = listing.list_runs(project, load_settings(project.root))
    first = next(r for r in view.runs if r.fingerprint != OTHER)
    assert listing.find_run(view, first.name) == first and listing.find_run(view, first.fingerprint[:6]) == first
    with pytest.raises(RunsError, match="names several runs"):
        listing.find_run(view, "64x1")
    with pytest.raises(RunsError, match="no run 'nope' in .*; its runs: 64x1-"):
        listing.find_run(view, "nope")
    labelled = changes.label_run(project, OTHER, "  wider\n try  ")
    assert labelled.label == "wider try"
    assert (project.checkpoints_dir(OTHER) / LABEL_FILE).read_text() == "wider try\n"
    assert listing.find_run(listing.list_runs(project, None), "wider try").fingerprint == OTHER
    with pytest.raises(RunsError, match="at most 200 characters"):
        changes.label_run(project, OTHER, "x" * 201)
    assert changes.label_run(project, OTHER, "").label == ""
    assert not (project.checkpoints_dir(OTHER) / LABEL_FILE).exists()


def test_delete_frees_a_run_and_never_the_current_one(project, tmp_path):
    second_run(project, finished=True)
    current = only_run_named(project, current=True)
    with pytest.raises(RunsError, match="is the current run"):
        changes.delete_run(project, current.name)
    assert project.checkpoints_dir(current.fingerprint).is_dir()
    # A file linked from elsewhere too frees nothing when the run goes: the freed figure says so.
    linked = tmp_path / "kept-elsewhere.safetensors"
    os.link(project.checkpoints_dir(OTHER) / FINAL_DIR / "adapter.safetensors", linked)
    used, freed = listing.disk_usage([project.checkpoints_dir(OTHER)])
    assert freed == used - linked.stat().st_blocks * 512 and freed > 0
    deleted = changes.delete_run(project, OTHER)
    assert (deleted.fingerprint, deleted.freed_bytes) == (OTHER, freed)
    assert not project.checkpoints_dir(OTHER).exists() and not (project.root / "checkpoints" / ".deleting").exists()
    assert linked.is_file() and [r.fingerprint for r in listing.list_runs(project, None).runs] == [current.fingerprint]


def only_run_named(paths: ProjectPaths, *, current: bool) -> listing.Run:
    return next(r for r in listing.list_runs(paths, load_settings(paths.root)).runs if r.current == current)


def test_use_refuses_a_run_that_its_settings_no_longer_make(project):
    """OTHER's settings are project.yaml's, which make the first run: it cannot come back, and nothing changes."""
    second_run(project, finished=True)
    before = project.project_file.read_bytes()
    gguf = (project.root / "output" / "demo-adapter.gguf").read_bytes()
    with pytest.raises(RunsError, match="cannot come back: its settings now make another training run"):
        changes.use_run(project, OTHER)
    assert project.project_file.read_bytes() == before
    assert (project.root / "output" / "demo-adapter.gguf").read_bytes() == gguf
    assert only_run_named(project, current=True).fingerprint != OTHER


def test_compare_overlays_two_runs_curves(project):
    second_run(project, finished=True)
    changes.label_run(project, OTHER, "<b>copy</b>")
    view = listing.list_runs(project, load_settings(project.root))
    first = next(r for r in view.runs if r.fingerprint != OTHER)
    compared, svg = compare.compare_runs(view, [first.name, OTHER])
    root = ET.fromstring(svg)  # well-formed: the label's markup is escaped
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and lines[0].get("stroke") != lines[1].get("stroke")
    assert f"{compared[1].name} (&lt;b&gt;copy&lt;/b&gt;)" in svg and compared[0].name in svg
    with pytest.raises(RunsError, match="the same run twice"):
        compare.compare_runs(view, [OTHER, OTHER[:6]])

    # Every compared score, step by step: one chart per score, a line per run in each, the run's colour in all.
    compared = compare.compare_scores(view, [first.name, OTHER])
    assert list(compared.curves) == [s.key for s in metrics.COMPARED]
    history = atomic.read_json(project.checkpoints_dir(first.fingerprint) / FINAL_DIR / META_FILE)["history"]
    rel_mse = [(e["step"], e["val_rel_mse"]) for e in history if "val_rel_mse" in e]
    assert len(rel_mse) == 2 and compared.curves["val_rel_mse"][first.name] == rel_mse  # validate_every 20 of 40
    assert compared.curves["val_centred_cosine"][first.name] == first.curve  # from the untrained adapter's (step 0)
    charts = ET.fromstring(compared.svg).findall("{http://www.w3.org/2000/svg}g")
    assert len(charts) == len(metrics.COMPARED)
    for chart in charts:
        lines = chart.findall("{http://www.w3.org/2000/svg}polyline")
        assert [line.get("stroke") for line in lines] == [RUN_COLOURS[0], RUN_COLOURS[1]]
    assert "val relative MSE (lower is better)" in compared.svg
    # The CLI: any number of runs, the last values as a table, the SVG to the file it names.
    svg = project.root.parent / "compare.svg"
    done = cli("runs", str(project.root), "--compare", first.name, OTHER, "<b>copy</b>", "--svg", str(svg))
    assert done.returncode == 2 and "the same run twice" in done.stderr  # the label names OTHER
    done = cli("runs", str(project.root), "--compare", first.name, OTHER, "--svg", str(svg))
    assert done.returncode == 0, done.stderr
    assert svg.read_text() == compared.svg
    assert f"wrote the curves, one chart per score, to {svg}" in unwrapped(done.stdout)
    assert_fits_80_columns(done.stdout)  # the runs by number, not by their 32-column names (98 wide)
    assert f"run 1: {first.name}\nrun 2: {compared.runs[1].name}" in done.stdout
    table = {cells[0]: cells[1:] for line in done.stdout.split("at the last validation")[1].splitlines()[1:]
             if len(cells := re.split(r" {2,}", line.strip())) == 3}
    last = first.last_scores  # OTHER is a copy of the first run's folder: the same scores
    assert table["step"] == ["40", "40"] and table["val relative MSE"] == [f"{last['val_rel_mse']:.4f}"] * 2
    assert table["worst query row"] == [f"{last['worst_row_cosine']:.4f} (row {last['worst_row']})"] * 2
    assert table["cosine after RMSNorm"] == [f"{last['val_rms_cosine']:.4f}"] * 2
    # Its GGUF's prompt retrieval (its kept report's), with the chance its val prompts give.
    heard, prompts = first.gguf_retrieval, first.gguf_retrieval[metrics.VAL_RETRIEVAL_PROMPTS]
    assert table["top-1"] == [f"{heard[metrics.VAL_RETRIEVAL_TOP1]:.3f}"] * 2
    assert table["margin"] == [f"{heard[metrics.VAL_RETRIEVAL_MARGIN]:.4f}"] * 2
    assert table["chance (top-1 / top-5)"] == [f"{1 / prompts:.3f} / {5 / prompts:.3f}"] * 2
    alone = cli("runs", str(project.root), "--compare", OTHER, "--json")
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["scores"]["val_rms_cosine"] == {
        f"{compared.runs[1].name} (<b>copy</b>)": [list(p) for p in compared.curves["val_rms_cosine"][
            f"{compared.runs[1].name} (<b>copy</b>)"]]}
    # No RUN (#65): two different runs, the newest and the best other; the SVG goes into the project, its path said.
    default = cli("runs", str(project.root), "--compare")
    assert default.returncode == 0, default.stderr
    lines = unwrapped(default.stdout)
    assert lines[0] == f"run 1: {first.name}" and lines[1].startswith(f"run 2: {compared.runs[1].name}"), lines
    written = project.root / "checkpoints" / "compare.svg"
    assert lines[-1] == f"wrote the curves, one chart per score, to {written}", lines
    assert ET.fromstring(written.read_text()).findall("{http://www.w3.org/2000/svg}g")


def test_a_snapshot_compares_like_a_run_its_curve_cut_at_its_step_and_its_gguf_s_scores(project, capsys):
    """#65: `runs --compare` takes a snapshot where it takes a run, by its file's name or as RUN@STEP: its curve is its
    run's cut at its step (with its step's validation), its scores its GGUF's evaluation (an unevaluated one: its
    step's validation, and the command that scores it); beside its own run, its line is its point at its step."""
    from gguf_assets.cli import main as trainer_main
    from gguf_assets.lib.core.commands import trainer
    from gguf_assets.lib.output.snapshots import read_snapshots

    run = only_run(project)
    root = str(project.root)
    assert trainer_main(["snapshot", root, "--step", "35", "--eval"]) == 0  # a checkpoint's step, evaluated
    assert trainer_main(["snapshot", root, "--step", "30"]) == 0  # not evaluated
    capsys.readouterr()
    at30, at35 = read_snapshots(project.checkpoints_dir(run.fingerprint))
    evaluated = at35["eval"]
    svg = project.root.parent / "compare.svg"
    assert trainer_main(["runs", root, "--compare", run.name, "output/demo-adapter-step35.gguf",
                         f"{run.fingerprint[:8]}@30", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert_fits_80_columns(out)
    lines = unwrapped(out)
    assert lines[:3] == [f"run 1: {run.name}", f"snapshot 2: demo-adapter-step35.gguf, step 35 (step35) of run "
                         f"{run.name}", f"snapshot 3: demo-adapter-step30.gguf, step 30 (step30) of run {run.name}"]
    by_step_rows, after = out.split("at the last validation")
    rows = {cells[0]: cells[1:] for line in by_step_rows.splitlines()
            if len(cells := re.split(r" {2,}", line.strip())) == 4}
    by_step = dict(run.curve)
    # By step: the run's validations (every 20 steps) to each snapshot's step, then the snapshot's own validation.
    assert rows["step"] == ["run 1", "snapshot 2", "snapshot 3"]
    assert rows["20"] == [f"{by_step[20]:.4f}"] * 3
    assert rows["30"] == ["-", "-", f"{at30['val_centred_cosine']:.4f}"]
    assert rows["35"] == ["-", f"{at35['val_centred_cosine']:.4f}", "-"]
    assert rows["40"] == [f"{by_step[40]:.4f}", "-", "-"]
    assert rows["final"] == [f"{run.final_val_centred_cosine:.4f}", f"{at35['val_centred_cosine']:.4f}",
                             f"{at30['val_centred_cosine']:.4f}"]
    # Its scores: its GGUF's evaluation; the unevaluated one's, its step's validation (no relative MSE there).
    last = {cells[0]: cells[1:] for line in after.splitlines() if len(cells := re.split(r" {2,}", line.strip())) == 4}
    assert last["step"] == ["40", "35", "30"]
    assert last["val relative MSE"] == [f"{run.last_scores['val_rel_mse']:.4f}", f"{evaluated['val_rel_mse']:.4f}",
                                        "-"]
    assert last["val centred cosine of its GGUF"] == [f"{run.gguf_val_centred_cosine:.4f}",
                                                      f"{evaluated['val_centred_cosine']:.4f}", "-"]
    assert last["top-1"] == [f"{run.gguf_retrieval['val_retrieval_top1']:.3f}",
                             f"{evaluated['val_retrieval_top1']:.3f}", "-"]
    scores_it = trainer("snapshot", project.root, "--step", "30", "--eval")
    assert f"snapshot 3 has no GGUF evaluation yet: `{scores_it}` scores it" in " ".join(lines), lines
    # Beside its own run, a snapshot's line is its point at its step: the history is the run's, drawn once.
    chart = ET.fromstring(svg.read_text()).findall("{http://www.w3.org/2000/svg}g")[0]
    points = [line.get("points").split() for line in chart.findall("{http://www.w3.org/2000/svg}polyline")]
    assert [len(p) for p in points] == [2, 1, 1], points
    # For tools: the snapshot's record comes with it.
    assert trainer_main(["runs", root, "--compare", f"{run.name}@35", "--json"]) == 0
    (compared,) = json.loads(capsys.readouterr().out)["runs"]
    assert compared["snapshot"] == {"file": "output/demo-adapter-step35.gguf", "step": 35, "weights": "step35",
                                    "run": run.name, "evaluated": True,
                                    "validated": {"val_centred_cosine": at35["val_centred_cosine"],
                                                  "empty_prompt_cosine": at35["empty_prompt_cosine"]}}
    # Refused in one line, naming what there is.
    assert trainer_main(["runs", root, "--compare", f"{run.name}@7"]) == 2
    assert (f"run {run.name} has no snapshot GGUF of step 7; its snapshots: demo-adapter-step30.gguf, "
            "demo-adapter-step35.gguf") in capsys.readouterr().err
    assert trainer_main(["runs", root, "--compare", "demo-adapter-step9.gguf", "demo-adapter-step35.gguf"]) == 2
    assert "no snapshot GGUF named 'demo-adapter-step9.gguf'" in capsys.readouterr().err
    assert trainer_main(["runs", root, "--compare", "demo-adapter-step35.gguf", f"{run.name}@35"]) == 2
    assert "the same run twice (or the same snapshot)" in capsys.readouterr().err


def test_use_puts_a_run_s_gguf_back_from_its_own_copy_and_never_a_damaged_copy(project):
    run = only_run(project)
    text = project.project_file.read_text()
    assert text.count("  steps: 40\n") == 1
    project.project_file.write_text(text.replace("  steps: 40\n", "  steps: 60\n"))
    gguf = project.root / "output" / "demo-adapter.gguf"
    original = gguf.read_bytes()
    gguf.unlink()  # gone from the output folder (deleted by hand, say)
    used = changes.use_run(project, run.name)
    assert used.changed == ["training.steps 60 → 40"] and project.project_file.read_text() == text
    assert gguf.read_bytes() == original and used.stages == ["adapter", "gguf", "eval_report"]
    assert "restored" not in used.next_run and used.next_run.startswith("nothing")
    assert {s.state for s in project_status(project, load_settings(project.root))} == {State.CURRENT}

    gguf.unlink()
    kept = project.root / run.kept_gguf
    data = bytearray(kept.read_bytes())
    data[-5] ^= 0x01  # a flipped bit in its kept copy: it is never put back
    kept.write_bytes(bytes(data))
    used = changes.use_run(project, run.name)
    assert "its GGUF was not restored" in used.next_run and "sha256 differs" in used.next_run, used.next_run
    assert "exports and evaluates it again from its finished weights, without training" in used.next_run
    assert used.stages == ["adapter"] and not gguf.exists()
    states = {s.stage: s.state for s in project_status(project, load_settings(project.root))}
    assert states["adapter"] == State.CURRENT and states["gguf"] in (State.DAMAGED, State.MISSING), states
