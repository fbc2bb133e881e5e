"""Shard partitions run as parallel Dagster runs (launched by the instance's run launcher) with the
same bytes as a serial run."""

import os
import time

import dagster as dg
import pytest

from gguf_assets.orchestration.launching import run_pipeline
from gguf_assets.orchestration.workers import worker_gpus
from gguf_assets.pipeline.plan import split_range


def _workers_run(paths, fault: str):
    """`gguf-trainer run --workers 2` in a session of its own, its output piped, under GGUF_ASSETS_FAULT=fault."""
    import subprocess

    from conftest import CLI, cli_env

    return subprocess.Popen([*CLI, "run", str(paths.root), "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=cli_env(GGUF_ASSETS_FAULT=fault))


def test_split_range_is_contiguous_and_complete():
    keys = [f"{i:05d}" for i in range(7)]
    ranges = split_range(keys, 3)
    assert ranges == [tuple(keys[0:2]), tuple(keys[2:5]), tuple(keys[5:7])]
    assert split_range(keys[:1], 4) == [("00000",)]


def test_auto_workers_are_one_per_visible_gpu_each_pinned_to_its_own(monkeypatch):
    from gguf_assets.lib.demo.demo import demo_settings
    from gguf_assets.lib.project.settings import replace
    from gguf_assets.lib.telemetry.hardware import CUDA_VISIBLE_DEVICES, GPU_COUNT_ENV

    settings = replace(demo_settings(), precompute={"device": "auto"})  # the demo's own says cpu
    monkeypatch.delenv(CUDA_VISIBLE_DEVICES, raising=False)
    monkeypatch.setenv(GPU_COUNT_ENV, "0")
    assert worker_gpus(settings, "auto") == [None]  # a CPU machine: one worker
    assert worker_gpus(settings, 2) == [None, None]  # as many as asked, none pinned
    monkeypatch.setenv(GPU_COUNT_ENV, "2")
    assert worker_gpus(settings, "auto") == ["0", "1"]
    assert worker_gpus(settings, 3) == ["0", "1", "0"]  # more workers than GPUs take them in turn
    assert worker_gpus(settings, None) == worker_gpus(settings, 1) == [None]  # one worker sees every GPU, as before
    monkeypatch.setenv(CUDA_VISIBLE_DEVICES, "5,7")  # the user's choice of GPUs
    assert worker_gpus(settings, "auto") == ["5", "7"]
    # A precompute.device naming one device is the user's choice too: nothing to share out.
    assert worker_gpus(replace(settings, precompute={"device": "cpu"}), "auto") == [None]


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_auto_workers_each_get_their_own_gpu_and_give_byte_identical_shards(make_project, reference_run, monkeypatch):
    """`run --workers auto` on a machine with 2 GPUs (GGUF_ASSETS_GPU_COUNT stands in for them here): the train
    shards as two Dagster runs of their own (each in its own process), each pinned to its own GPU, which each shard
    records, and every output byte-identical to the reference pipeline's single run."""
    from conftest import FAULT_SETTINGS, pipeline_outputs

    from gguf_assets.lib.core import atomic
    from gguf_assets.lib.telemetry.hardware import CUDA_VISIBLE_DEVICES, GPU_COUNT_ENV

    monkeypatch.delenv(CUDA_VISIBLE_DEVICES, raising=False)
    monkeypatch.setenv(GPU_COUNT_ENV, "2")
    parallel = make_project(**FAULT_SETTINGS, precompute={"device": "auto"})  # the demo's own says cpu
    start = time.perf_counter()
    said = []
    run_pipeline(parallel, echo=said.append, workers="auto")
    print(f"whole pipeline: 2 workers {time.perf_counter() - start:.1f}s, serial {reference_run[1]:.1f}s (a CLI run)")
    assert "--workers auto: 2 shard worker(s), one per GPU (0, 1)" in said, said
    assert pipeline_outputs(parallel.root) == reference_run[0]
    # Two separate runs covered the train shards, and every partition is recorded.
    instance = dg.DagsterInstance.get()
    from gguf_assets.pipeline.run_tags import GPU_TAG, PID_TAG, RANGE_START_TAG, WORKER_TAG

    worker_runs = [r.dagster_run for r in instance.get_run_records() if WORKER_TAG in r.dagster_run.tags]
    # Two train ranges ran as worker runs of the named job, each in its own process and on its own GPU; the
    # single val shard needs no split.
    assert sorted((r.tags[RANGE_START_TAG], r.tags[GPU_TAG]) for r in worker_runs) == [("00000", "0"), ("00002", "1")]
    assert {r.job_name for r in worker_runs} == {"precompute_train_shards"}
    assert len({r.tags[PID_TAG] for r in worker_runs} | {str(os.getpid())}) == 3
    assert len(instance.get_materialized_partitions(dg.AssetKey("train_shards"))) == 4
    # Each shard half records the environment its worker ran in: the GPU it was pinned to, and its device.
    seen = {key: {(meta.get(CUDA_VISIBLE_DEVICES.lower()), meta["device"])
                  for half in ("teacher", "student")
                  for meta in [atomic.read_json(parallel.root / f"shards/train/{key}/{half}.json")]}
            for key in ("00000", "00001", "00002", "00003")}
    assert seen == {"00000": {("0", "cpu")}, "00001": {("0", "cpu")}, "00002": {("1", "cpu")},
                    "00003": {("1", "cpu")}}


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_killing_only_the_workers_leader_refuses_a_new_run_until_its_workers_are_done(make_project, reference_run):
    """`run --workers 2`, then a kill -9 of `gguf-trainer run` alone once both worker runs started: the
    worker runs go on under their code server, so a new `run` is refused while they write (two teachers
    at once, otherwise), and once they are done their shards are a serial run's, byte for byte, and `status` counts
    them current (the next `run` from such shards is test_a_killed_worker_…'s)."""
    import signal

    from conftest import FAULT_SETTINGS, cli_env, pipeline_outputs, wait_for
    from warm_runs import trainer_run

    from gguf_assets.lib.core.lock import is_locked

    paths = make_project(**FAULT_SETTINGS)
    # Each worker stalls 30 s at its first shard write, so they are surely still writing after the kill, and while the
    # refused `run` starts (its imports alone take 10 s and more on a loaded 2-core machine).
    proc = _workers_run(paths, "shard-write@1:stall:30")
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "(worker 2/2)" in line:
                break
        assert any("(worker 2/2)" in line for line in seen), "".join(seen)
        # Both workers hold their lock and compute (each has laid out its first shard, 00000 and 00002).
        firsts = [paths.root / f"shards/train/{key}/prompts.jsonl" for key in ("00000", "00002")]
        wait_for(lambda: all(f.is_file() for f in firsts),
                 timeout=120, what="both workers at their first shard")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the leader only: the worker runs are not in its process group
        proc.wait()
    refused = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "still written by the worker runs of an earlier pipeline" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    wait_for(lambda: not is_locked(paths.lock_file), timeout=240, what="the worker runs to finish")
    train_shards = {name: data for name, data in pipeline_outputs(paths.root).items() if name.startswith("shards/")}
    assert train_shards and train_shards == {name: data for name, data in reference_run[0].items()
                                             if name.startswith("shards/train/")}
    status = trainer_run(["status", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert any(line.split()[:2] == ["train_shards", "current"] for line in status.stdout.splitlines()), status.stdout


@pytest.mark.slow  # a `run --workers 2` and a `run` (about 60 s)
def test_a_killed_worker_is_named_with_its_shard_and_the_next_run_continues(make_project, reference_run):
    """kill -9 of one worker run's process, while the other fails on its own (a full disk at its second shard
    write): the leader does not wait for the killed one forever, says which worker and which shard, and that `run`
    continues; the webhook (output.notify_url) hears of the pipeline's end once, from the leader, not once per
    worker run (#65); the next `run` finishes byte-identical."""
    import signal

    from conftest import FAULT_SETTINGS, cli_env, pipeline_outputs, project_instance, wait_for
    from warm_runs import trainer_run
    from webhook_server import webhook_receiver

    from gguf_assets.pipeline import run_tags

    with webhook_receiver() as hook:
        paths = make_project(**FAULT_SETTINGS, output={"notify_url": hook.url})
        proc = _workers_run(paths, "shard-write@1:stall:15,shard-write@2:enospc")
        try:
            instance = project_instance(paths)

            def worker_pid() -> int | None:
                for run in instance.get_runs():
                    if run_tags.get(run.tags, run_tags.WORKER_TAG) == "1/2" and run_tags.get(run.tags,
                                                                                              run_tags.PID_TAG):
                        return int(run_tags.get(run.tags, run_tags.PID_TAG))
                return None

            wait_for(lambda: worker_pid() is not None and (paths.root / "shards/train/00000/prompts.jsonl").is_file(),
                     timeout=180, what="worker 1 at its first shard", proc=proc)
            os.kill(worker_pid(), signal.SIGKILL)
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    assert "worker 1/2 (run " in out and "stopped, at shard train/00000: its process was killed" in out, out
    assert "worker 2/2 (run " in out and "No space left on device" in out, out
    assert "gguf-trainer run " in out and "continues with the rest" in out, out
    assert "\x1b[" not in out and "code_server" not in out, out  # no library noise on the console
    ((_, notice),) = hook.posts
    workers = {run.run_id for run in instance.get_runs() if run_tags.get(run.tags, run_tags.WORKER_TAG)}
    assert (notice["outcome"], notice["job"]) == ("failed", "precompute_train_shards") and notice["run_id"] in workers
    assert "worker 1/2 (run " in notice["message"] and "worker 2/2 (run " in notice["message"], notice
    done = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == reference_run[0]


@pytest.mark.slow  # a `run --workers 2` stopped at its first shards (about 30 s)
def test_a_stopped_workers_pipeline_is_told_once_as_stopped(make_project):
    """#65: Ctrl-C to `run --workers 2` while both worker runs write their first shard: the leader stops them, and
    the webhook (output.notify_url) hears of the pipeline's end once, as stopped, from the leader; the worker runs'
    own ends (their teardowns run before Dagster records them canceled) send nothing."""
    import signal

    from conftest import FAULT_SETTINGS, project_instance, wait_for
    from webhook_server import webhook_receiver

    from gguf_assets.pipeline import run_tags
    from gguf_assets.pipeline.run_end import STOPPED_MESSAGE

    with webhook_receiver() as hook:
        paths = make_project(**FAULT_SETTINGS, output={"notify_url": hook.url})
        proc = _workers_run(paths, "shard-write@1:stall:30")
        try:
            firsts = [paths.root / f"shards/train/{key}/prompts.jsonl" for key in ("00000", "00002")]
            wait_for(lambda: all(f.is_file() for f in firsts), timeout=180, what="both workers at their first shard",
                     proc=proc)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
            instance = project_instance(paths)
            workers = [r.run_id for r in instance.get_runs() if run_tags.get(r.tags, run_tags.WORKER_TAG)]
            wait_for(lambda: all(instance.get_run_by_id(r).is_finished for r in workers), timeout=120,
                     what="the worker runs to end")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert len(workers) == 2 and all(instance.get_run_by_id(r).status == dg.DagsterRunStatus.CANCELED
                                     for r in workers), [instance.get_run_by_id(r).status for r in workers]
    ((_, notice),) = hook.posts
    assert (notice["outcome"], notice["job"], notice["message"]) == ("stopped", "precompute_train_shards",
                                                                    STOPPED_MESSAGE), notice
    assert notice["run_id"] in workers, notice
