"""Fault injection: SIGKILL and a full disk at random moments and at named points of real runs.

After each fault the rerun finishes and its shards, weights and GGUF are byte-identical to an
uninterrupted run. Random moments come from a seed that is printed (fix it with
GGUF_FAULT_SEED to reproduce a failure). Named points (``gguf_assets.lib.core.faults``) make the
short, dangerous moments certain: inside a shard write, a checkpoint save, the GGUF export
and a hub download; which occurrence and how much of the file is torn are drawn from the seed.
"""

import errno
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import CLI, FAULT_SETTINGS, cli_env, pipeline_outputs
from safetensors.torch import load as safetensors_load
from warm_runs import trainer_popen, trainer_run

from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.materials.hub import HubOptions
from gguf_assets.lib.materials.hub.hf_private import INCOMPLETE_SUFFIX
from gguf_assets.lib.project.layout import STATE_FILE
from gguf_assets.orchestration.launching import run_pipeline
from gguf_assets.orchestration.outages import PipelineFailed

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

SHARD_HALVES = 5 * 2  # 4 train and 1 val shard under FAULT_SETTINGS, a teacher and a student half each
TRAIN_STEPS = FAULT_SETTINGS["steps"]
SEED = int(os.environ.get("GGUF_FAULT_SEED", time.time_ns() % 100_000))


def _resume(root: Path, *, auto_resume: bool = True) -> None:
    """`gguf-trainer --auto-resume` (as at boot) or a plain `gguf-trainer run` (the first command a user types)."""
    command = ["--auto-resume", str(root), "--no-daemon"] if auto_resume else ["run", str(root)]
    resumed = trainer_run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, f"seed {SEED}: {resumed.stdout}\n{resumed.stderr}"
    assert not list(root.rglob(f"{atomic.TEMP_PREFIX}*")), "temp files left after the rerun"


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"{atomic.TEMP_PREFIX}*") if ".dagster" not in p.parts]


def test_sigkill_at_random_moments_then_auto_resume_gives_identical_outputs(make_project, reference_run):
    """One project: `run` killed at a random moment, then `--auto-resume` killed at another, then `--auto-resume`
    to the end: byte-identical to an uninterrupted run. (Each kill lands anywhere in an uninterrupted run's time,
    so the second may hit the resumed pipeline's redone or skipped work, or a finished project.)"""
    expected, duration = reference_run
    rng = random.Random(SEED)
    project = make_project(**FAULT_SETTINGS)
    table = []
    for command in (["run", str(project.root)], ["--auto-resume", str(project.root), "--no-daemon"]):
        delay = rng.uniform(0.5, duration * 0.9)
        proc = trainer_popen(command, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        time.sleep(delay)
        finished_first = proc.poll() is not None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had already finished: that point tests a plain rerun
            pass
        proc.wait()
        begun = sorted({p.parts[len(project.root.parts)] for p in project.root.glob("*/**/*.json")})
        table.append((command[0], round(delay, 1), finished_first, begun))
    _resume(project.root)
    identical = pipeline_outputs(project.root) == expected
    print(f"\nfault seed {SEED}; uninterrupted run {duration:.1f}s; (command, kill at s, had finished, stages begun):")
    for row in table:
        print("  ", row)
    assert identical, f"seed {SEED}: outputs differ after kills {table}"


CHECKPOINT_EVERY = FAULT_SETTINGS["training"]["checkpoint_every"]


def _last_checkpoint_step(root: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in root.glob("checkpoints/*/step-*") if not p.name.startswith(".")]
    return max(steps, default=0)


def _visits_left(root: Path, point: str) -> int:
    """How often a run from the project's present state reaches ``point``; a fault's nth is drawn up to it."""
    if point == "shard-write":
        return SHARD_HALVES - len(list(root.glob("shards/*/*/*.safetensors")))
    if point == "train-step":  # stop before the last checkpoint, so a checkpoint save is still ahead
        return TRAIN_STEPS - _last_checkpoint_step(root) - CHECKPOINT_EVERY
    if point == "checkpoint-save":
        return (TRAIN_STEPS - _last_checkpoint_step(root)) // CHECKPOINT_EVERY
    return 1


# In pipeline order: each point, and where the kill leaves its torn temp file
NAMED_POINTS = [("shard-write", "shards/*/*/.tmp-*.safetensors.*"),
                ("train-step", None),
                ("checkpoint-save", f"checkpoints/*/.tmp-step-*/{STATE_FILE}"),
                ("gguf-export", "output/.tmp-*.gguf.*")]


def test_sigkill_at_each_named_point_in_turn_then_a_plain_run_gives_identical_outputs(make_project, reference_run):
    """One project, killed at every named point in pipeline order. Each plain `gguf-trainer run`
    continues from the previous kill (the dead run must not block it) and dies at the next point;
    the last one finishes, and its outputs are byte-identical to an uninterrupted run's."""
    rng = random.Random(f"{SEED}-named")
    project = make_project(**FAULT_SETTINGS)
    killed_at = []
    for point, torn_glob in NAMED_POINTS:
        fault = faults.Fault(point, nth=rng.randint(1, _visits_left(project.root, point)), action="kill",
                             fraction=round(rng.random(), 3))
        killed = trainer_run(["run", str(project.root)], env=cli_env(**{faults.ENV: fault.render()}),
                             capture_output=True, text=True, timeout=600, start_new_session=True)
        assert killed.returncode == -signal.SIGKILL, f"{fault.render()} did not kill the run: {killed.stderr[-2000:]}"
        if torn_glob:  # the kill left a torn write where the point sits, cut to the drawn fraction
            torn = list(project.root.glob(torn_glob))
            assert len(torn) == 1, f"{fault.render()}: {_temps(project.root)}"
        killed_at.append(fault.render())
    _resume(project.root, auto_resume=False)
    assert pipeline_outputs(project.root) == reference_run[0], f"seed {SEED}: outputs differ after kills at {killed_at}"
    print(f"\nkilled at {', '.join(killed_at)} (seed {SEED}); resumed each time; outputs identical")


# In pipeline order: each point, and what finished before it that must survive untouched
FULL_DISK_POINTS = [("shard-write", "corpus/manifest.json"),
                    ("checkpoint-save", "shards/val/*/teacher.safetensors"),
                    ("gguf-export", "checkpoints/*/final/adapter.safetensors")]


def test_a_full_disk_at_each_named_point_fails_clearly_and_redoes_nothing_finished(make_project, reference_run,
                                                                                  monkeypatch):
    """One project, the disk full at every named write in pipeline order: each run fails with the
    documented message and no torn temp, what was finished before stays untouched, and the final
    run's outputs are byte-identical to an uninterrupted run's."""
    rng = random.Random(f"{SEED}-enospc")
    project = make_project(**FAULT_SETTINGS)
    kept: dict[Path, int] = {}
    failed_at = []
    for point, kept_glob in FULL_DISK_POINTS:
        fault = faults.Fault(point, nth=rng.randint(1, _visits_left(project.root, point)), action="enospc",
                             fraction=round(rng.random(), 3))
        faults.reset()
        monkeypatch.setenv(faults.ENV, fault.render())
        with pytest.raises(PipelineFailed, match="No space left on device while writing") as failed:
            run_pipeline(project, echo=lambda _: None)
        assert "Free space on that disk and run again" in str(failed.value)
        assert not _temps(project.root), f"{fault.render()}: a torn temp file was left behind"
        assert {p: p.stat().st_mtime_ns for p in kept} == kept, f"{fault.render()}: finished work was redone"
        finished = {p: p.stat().st_mtime_ns for p in project.root.glob(kept_glob)}
        assert finished, f"{fault.render()}: {kept_glob}, finished before the full disk, is gone"
        kept.update(finished)
        failed_at.append(fault.render())

    monkeypatch.delenv(faults.ENV)
    run_pipeline(project, echo=lambda _: None)
    assert pipeline_outputs(project.root) == reference_run[0], f"seed {SEED}: outputs differ after {failed_at}"
    assert {p: p.stat().st_mtime_ns for p in kept} == kept, "finished work was redone after the full disk"
    print(f"\nfull disk at {', '.join(failed_at)} (seed {SEED}): clear errors, nothing finished redone, "
          "outputs identical")


def _tensor_bits(blob: bytes) -> dict[str, torch.Tensor]:
    return {k: v.contiguous().view(torch.uint8) for k, v in safetensors_load(blob).items()}


def test_sigkill_during_a_hub_download_then_auto_resume_continues_the_file(make_project, reference_run, loopback_hub,
                                                                         demo_materials_root):
    """The whole pipeline dies while the student's weights are half downloaded (the mock teacher
    needs no teacher download); the rerun continues that file with a Range request, and the
    results equal those built from local materials."""
    weights = f"demo/student/resolve/{loopback_hub.head('demo/student')}/model.safetensors"
    # The hub sends the first `sent` bytes of the 554 kB file, then holds the connection; the
    # downloader has written the whole 256 KiB chunks of it (HubOptions.chunk_bytes) when the
    # fault point fires.
    sent = random.Random(f"{SEED}-download").randint(HubOptions.chunk_bytes + 1, 550_000)
    loopback_hub.add_fault("stall", path_contains=weights, after_bytes=sent)
    project = make_project(**FAULT_SETTINGS, materials={"teacher": "demo/teacher", "student": "demo/student",
                                                        "datasets": ["demo/prompts"]})
    killed = subprocess.run([*CLI, "run", str(project.root)], env=cli_env(**{faults.ENV: "download@1:kill"}),
                            capture_output=True, text=True, timeout=600, start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # huggingface_hub names a partial <name hash>.<etag>.<random>.incomplete; the weights' etag is their sha256.
    etag = atomic.sha256_file(demo_materials_root / "student" / "model.safetensors")
    partials = list(project.root.rglob(f"*.{etag}.*{INCOMPLETE_SUFFIX}"))
    assert len(partials) == 1 and HubOptions.chunk_bytes <= partials[0].stat().st_size <= sent, (sent, partials)
    have = partials[0].stat().st_size

    _resume(project.root)
    assert [r["range"] for r in loopback_hub.file_requests("/model.safetensors") if weights in r["path"]] == [
        None, f"bytes={have}-"]
    # Same numbers as from local materials; the files' metadata differ (provenance, and the
    # training run's folder is named by a fingerprint that includes the pinned commits).
    expected, got = reference_run[0], pipeline_outputs(project.root)
    assert len(got) == len(expected)
    for (rel, blob), (want_rel, want_blob) in zip(got.items(), expected.items()):
        if want_rel.endswith(".safetensors"):
            have_bits, want_bits = _tensor_bits(blob), _tensor_bits(want_blob)
            assert have_bits.keys() == want_bits.keys(), rel
            assert all(torch.equal(have_bits[k], want_bits[k]) for k in want_bits), rel
    print(f"\ndownload killed with {have} bytes on disk (hub sent {sent}; seed {SEED}): continued by Range, "
          "tensors identical")


def test_atomic_write_on_a_full_disk_names_the_file_and_the_fix(tmp_path, monkeypatch):
    target = tmp_path / "out" / "data.bin"
    atomic.write_bytes(target, b"old")
    monkeypatch.setenv(faults.ENV, "shard-write:enospc:0.25")
    faults.reset()
    with pytest.raises(OSError) as failed, atomic.atomic_path(target) as tmp:
        tmp.write_bytes(b"new" * 100)
        faults.point("shard-write", tmp)
    assert failed.value.errno == errno.ENOSPC
    assert str(target) in str(failed.value) and "MiB free there" in str(failed.value)
    assert target.read_bytes() == b"old" and list(target.parent.iterdir()) == [target]


def test_fault_spec_parses_and_names_the_variable_on_a_typo():
    assert faults.parse("checkpoint-save@3:enospc:0.25") == faults.Fault("checkpoint-save", 3, "enospc", 0.25)
    assert faults.parse("gguf-export") == faults.Fault("gguf-export", 1, "kill", 0.5)
    assert faults.parse(faults.Fault("download", 2).render()) == faults.Fault("download", 2)
    for bad in ("checkpoint", "shard-write@0", "shard-write@x", "shard-write:explode", "train-step:kill:2"):
        with pytest.raises(faults.FaultSpecError, match=f"{faults.ENV}=.*points: download"):
            faults.parse(bad)


def test_fault_point_acts_only_at_its_nth_visit(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "train-step@3:enospc")
    faults.reset()
    faults.point("shard-write")  # another point: ignored, and not counted
    faults.point("train-step")
    faults.point("train-step")
    with pytest.raises(OSError, match="injected by GGUF_ASSETS_FAULT"):
        faults.point("train-step")
    faults.point("train-step")  # once only
    with pytest.raises(KeyError, match="faults.POINTS"):
        faults.point("no-such-point")


def test_a_fault_marks_where_it_acts_for_the_test_that_waits_on_it(tmp_path, monkeypatch):
    """GGUF_ASSETS_FAULT_REACHED: each fault first leaves <folder>/<point>.<pid>, so a test knows that a process it
    did not start itself (a Dagster code server) is at the point, and stops it there."""
    monkeypatch.setenv(faults.ENV, "definitions-import@2:stall:0")
    monkeypatch.setenv(faults.REACHED_ENV, str(tmp_path))
    faults.reset()
    faults.point("definitions-import")
    assert list(tmp_path.iterdir()) == []  # the first visit: no fault, no mark
    faults.point("definitions-import")
    assert [p.name for p in tmp_path.iterdir()] == [f"definitions-import.{os.getpid()}"]


def test_several_faults_each_act_at_their_own_moment(monkeypatch):
    monkeypatch.setenv(faults.ENV, "train-step@2:stall:0,gguf-export:enospc")
    faults.reset()
    assert faults.armed("train-step") and faults.armed("gguf-export") and not faults.armed("shard-write")
    faults.point("train-step")
    faults.point("train-step")  # the stall (0 s)
    with pytest.raises(OSError, match="injected by GGUF_ASSETS_FAULT"):
        faults.point("gguf-export")


def test_docs_list_every_fault_point():
    doc = (Path(__file__).parents[2] / "docs" / "faults.md").read_text()
    for name, moment in faults.POINTS.items():
        assert f"| `{name}` | {moment} |" in doc, f"docs/faults.md: add the row for fault point {name}"
