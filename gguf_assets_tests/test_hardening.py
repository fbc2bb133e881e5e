"""Damaged bookkeeping, late refusals and `gguf-trainer verify`, each through the real CLI on real files.

Each test works on a copy of one finished FAULT_SETTINGS project (conftest ``finished_project``),
breaks one thing the way a disk, a user or a crash would, and checks what the console says and that
the next `run` redoes exactly what is broken and nothing else.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import cli, cli_env, copy_project, pipeline_outputs, unwrapped, wait_for
from warm_runs import trainer_popen

from gguf_assets.lib.corpus.prompt_files import CorpusError, read_prompt_file
from gguf_assets.lib.output.export import ExportError, check_file_name
from gguf_assets.lib.project.settings import adapter_name_problem

GGUF = "output/demo-adapter.gguf"


def status_of(root: Path) -> dict[str, tuple[str, str]]:
    """`gguf-trainer status` as {stage: (state, detail)}, asked in this process (the command's own code: its stage
    lines are what is read here; the console tests run it as a process)."""
    import argparse
    import contextlib
    import io

    from gguf_assets.cli.commands import cmd_status

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cmd_status(argparse.Namespace(project=str(root))) == 0
    rows = {}
    for line in unwrapped(printed.getvalue()):  # the why is wrapped at 80 columns under its own column
        parts = line.split(maxsplit=2)
        if len(parts) >= 2 and parts[0] in ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf",
                                            "eval_report"):
            rows[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return rows


def assert_one_message(done: subprocess.CompletedProcess, *needles: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


def flip_byte(file: Path, offset: int = -100, *, keep_mtime: bool = True) -> None:
    """Silent disk corruption: one bit changed, size kept, and (by default) the mtime put back."""
    st = file.stat()
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    with open(file, "r+b") as fh:
        fh.write(data)
    if keep_mtime:
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def mtimes(root: Path) -> dict[Path, int]:
    """When each shard half, checkpoint file and final weights file was written: a redo changes it."""
    files = list(root.glob("shards/*/*/*.safetensors")) + list(root.glob("checkpoints/*/*/*.safetensors"))
    return {p: p.stat().st_mtime_ns for p in files}


def edit_settings(root: Path, **sections) -> None:
    file = root / "project.yaml"
    doc = yaml.safe_load(file.read_text())
    for section, values in sections.items():
        doc[section].update(values)
    file.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture
def copied(finished_project, tmp_path):
    return copy_project(finished_project[0], tmp_path / "copy").root


# -- the run history (Dagster's SQLite storage) -------------------------------------------------

@pytest.mark.slow  # two `gguf-trainer run` subprocesses (about 15 s)
def test_a_damaged_run_history_is_one_message_and_moving_it_away_loses_nothing(copied):
    runs_db = copied / ".dagster" / "history" / "runs.db"
    before = pipeline_outputs(copied)
    made = mtimes(copied)
    with open(runs_db, "r+b") as fh:
        fh.truncate(8192)
    done = cli("run", str(copied))
    assert_one_message(done, str(runs_db), "damaged", f"mv {copied / '.dagster'}", "nothing computed is lost")
    assert "sqlalchemy" not in done.stderr.lower().replace("(sqlite3.databaseerror)", "")

    shutil.move(copied / ".dagster", copied / ".dagster.damaged")  # the fix the message gives
    done = cli("run", str(copied))
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(copied) == before and mtimes(copied) == made  # nothing was made again
    assert {state for state, _ in status_of(copied).values()} == {"current"}


# -- damaged records: shown as damaged, redone -----------------------------------------------------

@pytest.mark.slow  # a `gguf-trainer run` subprocess (about 8 s)
@pytest.mark.parametrize("record", ["materials/manifest.json", "corpus/manifest.json"])
def test_a_truncated_manifest_shows_damaged_and_run_redoes_only_its_stage(copied, record):
    stage = record.split("/")[0]
    file = copied / record
    file.write_bytes(file.read_bytes()[:50])
    made = mtimes(copied)
    state, detail = status_of(copied)[stage]
    assert state == "damaged" and record in detail and "not valid JSON" in detail, detail

    done = cli("run", str(copied))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    json.loads(file.read_text())  # written again, whole
    assert {state for state, _ in status_of(copied).values()} == {"current"}
    # The corpus came out the same, so no shard was computed again and nothing was trained again.
    assert mtimes(copied) == made


def test_damaged_final_weights_and_shards_and_a_partial_training_say_what_was_found(copied):
    final = next(copied.glob("checkpoints/*/final/adapter.safetensors"))
    flip_byte(final, keep_mtime=False)
    state, detail = status_of(copied)["adapter"]
    assert state == "damaged" and "final/adapter.safetensors changed on disk" in detail, detail

    shard = copied / "shards" / "train" / "00001" / "teacher.safetensors"
    flip_byte(shard, keep_mtime=False)
    state, detail = status_of(copied)["train_shards"]
    assert state == "damaged" and "train/00001" in detail and "teacher half changed on disk" in detail, detail
    flip_byte(shard, keep_mtime=False)  # back as it was: the bytes decide, not the mtime
    assert status_of(copied)["train_shards"][0] == "current"

    run_dir = final.parent.parent
    shutil.rmtree(run_dir / "final")
    (copied / "checkpoints" / "final.json").unlink()
    steps = sorted(p for p in run_dir.glob("step-*"))
    for late in steps[-1:]:
        shutil.rmtree(late)
    kept = int(steps[-2].name.split("-")[1])
    state, detail = status_of(copied)["adapter"]
    assert state == "partial" and f"trained to step {kept} of 40" in detail and "resumes" in detail, detail

    (copied / "shards" / "val" / "00000" / "student.json").unlink()  # a shard run cut off before this half
    state, detail = status_of(copied)["val_shards"]
    assert state == "partial" and detail.startswith("0/1 shards current"), detail  # its teacher half is done
    (copied / "shards" / "val" / "00000" / "teacher.json").unlink()
    assert status_of(copied)["val_shards"] == ("missing", "0/1 shards current")
    (copied / "shards" / "train" / "00003" / "student.json").unlink()
    state, detail = status_of(copied)["train_shards"]
    assert state == "partial" and detail.startswith("3/4 shards current"), detail


# -- `gguf-trainer verify` ----------------------------------------------------------------------

@pytest.mark.slow  # a `gguf-trainer run` subprocess (about 8 s)
def test_verify_finds_a_silently_flipped_gguf_byte_and_repair_makes_run_export_it_again(copied, finished_project):
    original = (finished_project[0] / GGUF).read_bytes()
    done = cli("verify", str(copied))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 damaged, 0 missing" in done.stdout and " files ok" in done.stdout
    for stage in ("materials", "corpus", "train_shards", "val_shards", "checkpoints", "adapter", "gguf"):
        assert any(line.split()[:2] == [stage, "ok"] for line in done.stdout.splitlines()), (stage, done.stdout)

    flip_byte(copied / GGUF)
    assert status_of(copied)["gguf"][0] == "current"  # the stamp is intact: only a full read can tell
    done = cli("verify", str(copied))
    assert done.returncode == 1 and f"damaged: {GGUF}" in done.stdout, done.stdout
    assert "32 ok, 1 damaged" in done.stdout or "1 damaged, 0 missing" in done.stdout, done.stdout
    assert "--repair" in done.stdout

    done = cli("verify", str(copied), "--repair")
    assert done.returncode == 1 and "moved to demo-adapter.gguf.damaged" in done.stdout, done.stdout
    assert status_of(copied)["gguf"][0] == "damaged"
    made = mtimes(copied)
    done = cli("run", str(copied))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (copied / GGUF).read_bytes() == original
    assert mtimes(copied) == made  # only the export was redone
    assert cli("verify", str(copied)).returncode == 0


def test_verify_repair_of_a_shard_half_and_a_checkpoint_marks_exactly_those(copied):
    shard = copied / "shards" / "val" / "00000" / "student.safetensors"
    flip_byte(shard)
    checkpoint = sorted(copied.glob("checkpoints/*/step-*/adapter.safetensors"))[0]
    flip_byte(checkpoint)
    done = cli("verify", str(copied), "--repair")
    assert done.returncode == 1
    damaged = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.strip().startswith("damaged:")]
    assert sorted(damaged) == sorted(str(p.relative_to(copied)) for p in (shard, checkpoint)), done.stdout
    assert not shard.exists() and shard.with_name(shard.name + ".damaged").exists()
    state, detail = status_of(copied)["val_shards"]
    assert state in ("missing", "partial") and "0/1" in detail, (state, detail)
    assert cli("verify", str(copied)).returncode == 1  # the missing half is reported until the next run


# -- refused at load, or before any work --------------------------------------------------------

@pytest.mark.parametrize("name, why", [(" ", "blank"), ("a\nb", "control character"), ("a/b", "plain file name"),
                                       (" x", "starts or ends with a space")])
def test_an_adapter_name_is_refused_at_load_by_the_one_rule_export_applies_too(make_project, name, why):
    paths = make_project()
    edit_settings(paths.root, output={"adapter_name": name})
    done = cli("status", str(paths.root))
    assert_one_message(done, "output.adapter_name", why, "project.yaml:")
    with pytest.raises(ExportError, match=why):
        check_file_name(name)
    assert adapter_name_problem("my adapter") is None and check_file_name("my-adapter") == "my-adapter"


def test_an_output_dir_that_is_a_file_is_refused_before_any_work(make_project):
    paths = make_project()
    (paths.root / "not-a-folder").write_text("x")
    for key, value in (("output_dir", "not-a-folder"), ("also_copy_to", "not-a-folder/sub")):
        edit_settings(paths.root, output={"output_dir": "", "also_copy_to": "", key: value})
        done = cli("run", str(paths.root))
        assert_one_message(done, f"output.{key} = '{value}'", "is a file", "not a folder")
        assert not paths.materials_manifest.exists()  # nothing was started


def test_a_run_started_from_dagster_refuses_an_output_dir_that_is_a_file_too(make_project):
    """The same check guards every entry point: it runs where every Dagster run begins."""
    from gguf_assets.lib.project.layout import OutputFolderError
    from gguf_assets.pipeline.run_bookkeeping import RunBookkeeping

    paths = make_project()
    (paths.root / "out").write_text("x")
    edit_settings(paths.root, output={"output_dir": "out"})
    with pytest.raises(OutputFolderError, match="output.output_dir"):
        RunBookkeeping.begin(None, None, paths)


@pytest.mark.slow  # a `gguf-trainer run` subprocess up to the materials step (about 6 s)
def test_a_local_teacher_with_only_pickle_weights_is_refused_at_the_materials_step(make_project):
    paths = make_project()
    teacher = paths.root / "pickled-teacher"
    shutil.copytree(paths.root / "materials" / "demo" / "teacher", teacher)
    (teacher / "model.safetensors").rename(teacher / "pytorch_model.bin")
    edit_settings(paths.root, materials={"teacher": "pickled-teacher"})
    done = cli("run", str(paths.root))
    assert_one_message(done, "materials.teacher", "only pickle weights", "pytorch_model.bin", "safetensors")
    assert not (paths.root / "shards").exists()


def test_weights_under_a_name_transformers_does_not_load_are_refused_with_the_rename(make_project):
    from gguf_assets.lib.materials.materials_run import MaterialsError
    from gguf_assets.lib.materials.pinning.checks import check_model_folder
    from gguf_assets.lib.project.settings import load_settings

    paths = make_project()
    teacher = paths.root / "materials" / "demo" / "teacher"
    (teacher / "model.safetensors").rename(teacher / "weights.safetensors")
    with pytest.raises(MaterialsError, match="not named model.safetensors"):
        check_model_folder("teacher", "t", teacher, load_settings(paths.root))


# -- prompt files ---------------------------------------------------------------------------------

def test_a_lone_surrogate_in_a_prompt_names_file_and_line_and_is_skipped_when_asked(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n{"text": "ok \\u00e9"}\n')
    with pytest.raises(CorpusError, match=rf"{jsonl}:2: the prompt holds a lone surrogate"):
        list(read_prompt_file(jsonl))
    assert list(read_prompt_file(jsonl, skip_bad_lines=True)) == ["fine", "ok é"]
    as_json = tmp_path / "p.json"
    as_json.write_text('["fine",\n {"text": "\\udfff"}]')
    with pytest.raises(CorpusError, match=rf"{as_json}:2: item 1: the prompt holds a lone surrogate"):
        list(read_prompt_file(as_json))
    assert list(read_prompt_file(as_json, skip_bad_lines=True)) == ["fine"]


@pytest.mark.slow  # a `gguf-trainer run` subprocess up to the corpus step (about 8 s)
def test_a_lone_surrogate_fails_the_corpus_with_file_and_line_from_the_cli(make_project):
    paths = make_project()
    extra = paths.root / "extra.jsonl"
    extra.write_text('{"text": "a prompt"}\n' * 3 + '{"text": "\\ud800"}\n')
    edit_settings(paths.root, corpus={"local_prompt_files": ["extra.jsonl"]})
    done = cli("run", str(paths.root))
    assert_one_message(done, f"{extra}:4", "lone surrogate", "skip_bad_lines")



# -- a full disk ----------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 120 MiB tmpfs of its own, so the test fills a disk without filling the machine's."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.slow  # two `gguf-trainer run` subprocesses (about 40 s)
def test_a_disk_that_fills_during_training_is_one_line_and_the_next_run_finishes_untorn(finished_project,
                                                                                        small_disk, monkeypatch):
    import dagster as dg
    from conftest import project_instance

    from gguf_assets.orchestration.instance import instance_env

    source = finished_project[0]
    paths = copy_project(source, small_disk / "project")
    shutil.rmtree(paths.root / "checkpoints")
    shutil.rmtree(paths.root / "output")
    # Training stalls after step 10, while the disk (project and Dagster storage alike) is filled.
    proc = trainer_popen(["run", str(paths.root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env=cli_env(GGUF_ASSETS_FAULT="train-step@11:stall:10"))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 10/40" in line:
            break
    # The step's checkpoint is written after its log line: fill the disk only once it is there (under load,
    # the filler once won that race, and the checkpoint's own error came instead of the storage one).
    wait_for(lambda: any(paths.root.glob("checkpoints/*/step-00000010/meta.json")), timeout=60,
             what="the step-10 checkpoint", proc=proc)
    filler = small_disk / "filler"
    with pytest.raises(OSError), open(filler, "wb") as fh:
        while True:
            fh.write(b"\0" * 2**20)
    out = "".join(seen) + proc.stdout.read()
    proc.wait(timeout=300)
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "sqlalchemy" not in out.lower() and "INSERT INTO" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on the disk holding" in errors[0] and "MiB free" in errors[0], out

    filler.unlink()  # space is back
    done = cli("run", str(paths.root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "marked 1 run(s) cut off" in done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == pipeline_outputs(source)
    assert cli("verify", str(paths.root)).returncode == 0
    for name, value in instance_env(paths).items():  # restored after the test
        monkeypatch.setenv(name, value)
    statuses = [r.status for r in project_instance(paths).get_runs() if r.job_name == "train_export_evaluate"]
    assert dg.DagsterRunStatus.FAILURE in statuses and statuses[0] == dg.DagsterRunStatus.SUCCESS


def test_the_gguf_and_report_checks_read_every_delivered_byte(copied):
    """The asset checks beside gguf and eval_report (the UI's "Execute checks") hash the delivered files
    whatever their stamps say, so a flipped bit with its mtime restored fails both."""
    from gguf_assets.defs.output import exported_files_unchanged, reported_files_unchanged
    from gguf_assets.defs.resources import ProjectResource

    project = ProjectResource(project_dir=str(copied))
    assert exported_files_unchanged(project=project).passed and reported_files_unchanged(project=project).passed
    flip_byte(copied / GGUF)
    for check in (exported_files_unchanged, reported_files_unchanged):
        result = check(project=project)
        assert not result.passed and "its sha256 changed since the export" in result.metadata["problems"].value
