"""Shard partitions run as parallel Dagster runs (launched by the instance's run launcher) with the
same bytes as a serial run."""

import os
import time

import dagster as dg
import pytest

from gguf_assets.orchestration.launching import run_pipeline
from gguf_assets.orchestration.plan import split_range


def test_split_range_is_contiguous_and_complete():
    keys = [f"{i:05d}" for i in range(7)]
    ranges = split_range(keys, 3)
    assert ranges == [tuple(keys[0:2]), tuple(keys[2:5]), tuple(keys[5:7])]
    assert split_range(keys[:1], 4) == [("00000",)]


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_two_workers_give_byte_identical_shards(make_project, reference_run):
    """`run --workers 2`: the train shards as two Dagster runs of their own (each in its own process), and every
    output byte-identical to the reference pipeline's single run."""
    from conftest import FAULT_SETTINGS, pipeline_outputs

    parallel = make_project(**FAULT_SETTINGS)
    start = time.perf_counter()
    run_pipeline(parallel, echo=lambda _: None, workers=2)
    print(f"whole pipeline: 2 workers {time.perf_counter() - start:.1f}s, serial {reference_run[1]:.1f}s (a CLI run)")
    assert pipeline_outputs(parallel.root) == reference_run[0]
    # Two separate runs covered the train shards, and every partition is recorded.
    instance = dg.DagsterInstance.get()
    from gguf_assets.orchestration.run_tags import PID_TAG, RANGE_START_TAG, WORKER_TAG

    worker_runs = [r.dagster_run for r in instance.get_run_records() if WORKER_TAG in r.dagster_run.tags]
    # Two train ranges ran as worker runs of the named job, each in its own process; the single
    # val shard needs no split.
    assert sorted(r.tags[RANGE_START_TAG] for r in worker_runs) == ["00000", "00002"]
    assert {r.job_name for r in worker_runs} == {"precompute_train_shards"}
    assert len({r.tags[PID_TAG] for r in worker_runs} | {str(os.getpid())}) == 3
    assert len(instance.get_materialized_partitions(dg.AssetKey("train_shards"))) == 4


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_killing_only_the_workers_leader_refuses_a_new_run_until_its_workers_are_done(make_project, reference_run):
    """`run --workers 2`, then a kill -9 of `gguf-trainer run` alone once both worker runs started: the
    worker runs go on under their code server, so a new `run` is refused while they write (two teachers
    at once, otherwise), and once they are done the next `run` finishes byte-identical."""
    import signal
    import subprocess

    from conftest import CLI, FAULT_SETTINGS, cli_env, pipeline_outputs, wait_for

    from gguf_assets.lib.core.lock import is_locked

    paths = make_project(**FAULT_SETTINGS)
    # Each worker stalls 15 s at its first shard write, so they are surely still writing after the kill.
    proc = subprocess.Popen([*CLI, "run", str(paths.root), "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=cli_env(GGUF_ASSETS_FAULT="shard-write@1:stall:15"))
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
    refused = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                             timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "still written by the worker runs of an earlier pipeline" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    wait_for(lambda: not is_locked(paths.lock_file), timeout=240, what="the worker runs to finish")
    done = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == reference_run[0]


@pytest.mark.slow  # a `run --workers 2` and a `run` (about 60 s)
def test_a_killed_worker_is_named_with_its_shard_and_the_next_run_continues(make_project, reference_run):
    """kill -9 of one worker run's process: the leader does not wait for it forever, says which worker and
    which shard, and that `run` continues; the next `run` finishes byte-identical."""
    import signal
    import subprocess

    from conftest import CLI, FAULT_SETTINGS, cli_env, pipeline_outputs, project_instance, wait_for

    from gguf_assets.orchestration import run_tags

    paths = make_project(**FAULT_SETTINGS)
    proc = subprocess.Popen([*CLI, "run", str(paths.root), "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=cli_env(GGUF_ASSETS_FAULT="shard-write@1:stall:15"))
    try:
        instance = project_instance(paths)

        def worker_pid() -> int | None:
            for run in instance.get_runs():
                if run_tags.get(run.tags, run_tags.WORKER_TAG) == "1/2" and run_tags.get(run.tags, run_tags.PID_TAG):
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
    assert "gguf-trainer run " in out and "continues with the rest" in out, out
    assert "\x1b[" not in out and "code_server" not in out, out  # no library noise on the console
    done = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == reference_run[0]
