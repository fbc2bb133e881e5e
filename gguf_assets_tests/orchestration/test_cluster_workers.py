"""The same DAG on Celery workers: real Postgres, real Redis, two `gguf-trainer worker` processes, on loopback.

The two workers run as two hosts would: separate processes in their own sessions, each with its own
environment, working folder and HOME, and each mounting the project folder at a path of its own. A
kill -9 of one worker in the middle of a shard: the pipeline plans that shard again, the other
worker (or the restarted one) computes it, and the results are byte-identical to a single-machine
run; a second delivery of a run's task meanwhile is dropped. No URL, worker path or host name lands in
the project folder, and every record is in Postgres (none in SQLite; a second run finds everything current there).
Restarts and outages of Postgres and Redis during the shards, the training and the
GGUF export are ridden out, byte-identical too.
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import CLI, FAULT_SETTINGS, cli_env, free_port, pipeline_outputs, project_instance, wait_for
from servers import postgres_server, redis_server, start_postgres, stop_postgres

pytestmark = pytest.mark.slow  # two servers, two workers and a whole pipeline

PG_ENV, REDIS_ENV = "GGUF_ASSETS_POSTGRES_URL", "GGUF_ASSETS_REDIS_URL"


def _celery(redis_url: str):
    from celery import Celery

    return Celery("gguf-test", broker=redis_url, backend=redis_url)


class Worker:
    """`gguf-trainer worker` as one host would run it: its own folder, HOME, mount of the project and session."""

    def __init__(self, host: Path, project: Path, urls: dict[str, str], name: str, **extra_env: str) -> None:
        self.host, self.name = host, name
        host.mkdir(parents=True, exist_ok=True)
        self.mount = host / "mnt" / "project"  # this host's path to the shared folder
        if not self.mount.exists():
            self.mount.parent.mkdir(parents=True)
            self.mount.symlink_to(project, target_is_directory=True)
        self.env = cli_env(**urls, HOME=str(host), **extra_env)
        self.log = host / "worker.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Worker":
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([*CLI, "worker", str(self.mount), "--name", f"{self.name}@%h"], cwd=self.host,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the whole host goes: the worker and its run's process
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _answering(redis_url: str) -> set[str]:
    replies = _celery(redis_url).control.ping(timeout=1.0) or []
    return {name.split("@")[0] for reply in replies for name in reply}


def _wait_for_workers(redis_url: str, *workers: Worker, timeout: float = 180) -> None:
    """Until each worker has answered a ping, not necessarily the same one: on a loaded machine one of two busy
    workers can miss a ping's 1 s window many times in a row. On a timeout the message holds each worker's log."""
    seen: set[str] = set()

    def all_seen() -> bool:
        seen.update(_answering(redis_url))
        return seen >= {w.name for w in workers}

    try:
        wait_for(all_seen, timeout=timeout, what="the workers")
    except AssertionError as exc:
        logs = "\n".join(f"--- {w.name} (exit {w.proc.poll()}), answered: {w.name in seen}\n"
                         f"{w.log.read_text()[-3000:]}" for w in workers)
        raise AssertionError(f"{exc}\n{logs}") from None


@pytest.fixture
def servers(tmp_path):
    with postgres_server(tmp_path / "postgres", free_port()) as pg, \
            redis_server(tmp_path / "redis", free_port()) as redis:
        yield {PG_ENV: pg, REDIS_ENV: redis.url}


def _deliver_again(redis_url: str, run) -> None:
    """The run's Celery task once more, as the launcher sent it (same task id): a redelivery by the broker."""
    from dagster_celery.tags import DAGSTER_CELERY_TASK_ID_TAG
    from dagster_celery.tasks import create_execute_job_task

    from gguf_assets.orchestration.cluster_workers import ClusterRunLauncher
    from gguf_assets.pipeline.private_api import ExecuteRunArgs, pack_value

    app = ClusterRunLauncher(broker=redis_url, backend=redis_url, default_queue="gpu").celery
    args = ExecuteRunArgs(job_origin=run.job_code_origin, run_id=run.run_id, instance_ref=None,
                          set_exit_code_on_failure=True)
    create_execute_job_task(app).si(execute_job_args_packed=pack_value(args)).apply_async(
        queue="gpu", routing_key="gpu.execute_job", task_id=run.tags[DAGSTER_CELERY_TASK_ID_TAG])


def _run_by(pid_tag: str | None, worker: Worker) -> bool:
    """Whether a run's process (its pid tag) is a child of this worker."""
    try:
        return pid_tag is not None and psutil.Process(int(pid_tag)).ppid() == worker.proc.pid
    except psutil.Error:
        return False


@pytest.fixture
def webhook():
    from webhook_server import webhook_receiver

    with webhook_receiver() as hook:
        yield hook


def test_two_workers_run_the_pipeline_and_a_killed_worker_s_shards_are_done_again(make_project, reference_run,
                                                                                   servers, tmp_path, monkeypatch,
                                                                                   webhook):
    import dagster as dg

    from gguf_assets.pipeline import run_tags

    paths = make_project(**FAULT_SETTINGS, output={"notify_url": webhook.url})
    done = subprocess.run([*CLI, "cluster", str(paths.root), "--celery-broker-env", REDIS_ENV], capture_output=True,
                          text=True, env=cli_env(), timeout=60)
    assert done.returncode == 0 and f"export {REDIS_ENV}=" in done.stdout and "worker" in done.stdout, done.stdout
    # Without the URLs in the environment: one clear line, nothing started.
    refused = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                             timeout=120)
    assert refused.returncode == 2 and f"${PG_ENV}, which is not set" in refused.stderr, refused.stderr
    assert not paths.materials_manifest.exists()

    # Worker a stalls at its first shard write: the kill lands in the middle of a shard.
    a = Worker(tmp_path / "host-a", paths.root, servers, "gguf-a", GGUF_ASSETS_FAULT="shard-write@1:stall:120").start()
    b = Worker(tmp_path / "host-b", paths.root, servers, "gguf-b").start()
    leader = None
    try:
        _wait_for_workers(servers[REDIS_ENV], a, b)
        with open(tmp_path / "run.log", "w") as out:
            leader = subprocess.Popen([*CLI, "run", str(paths.root), "--workers", "2"], stdout=out,
                                      stderr=subprocess.STDOUT, text=True, env=cli_env(**servers))
        for name, url in servers.items():
            monkeypatch.setenv(name, url)
        instance = project_instance(paths)

        def a_shard_run():  # worker a's run of a train shard range (a may have taken materials first)
            return next((r for r in instance.get_runs(filters=dg.RunsFilter(
                statuses=[dg.DagsterRunStatus.STARTED], job_name="precompute_train_shards"))
                if _run_by(run_tags.get(r.tags, run_tags.PID_TAG), a)), None)

        wait_for(lambda: a_shard_run() is not None, timeout=240, what="worker a's shard run", proc=leader)
        a_run = a_shard_run()
        first = run_tags.get(a_run.tags, run_tags.RANGE_START_TAG)
        wait_for(lambda: (paths.root / f"shards/train/{first}/prompts.jsonl").is_file(), timeout=120,
                 what="worker a inside its first shard", proc=leader)
        # The broker hands a's run out again (as kombu does with a worker's unacknowledged tasks when its connection
        # to Redis breaks): b, idle once its own range is done, drops it instead of starting the run a second time
        # (which Dagster would answer by marking the run failed under a).
        wait_for(lambda: any(r.status == dg.DagsterRunStatus.SUCCESS and r.run_id != a_run.run_id
                             for r in instance.get_runs(filters=dg.RunsFilter(job_name="precompute_train_shards"))),
                 timeout=240, what="worker b's shard run", proc=leader)
        _deliver_again(servers[REDIS_ENV], a_run)
        wait_for(lambda: f"run {a_run.run_id[:8]}: its task came again" in b.log.read_text(), timeout=60,
                 what="worker b to drop the second delivery", proc=leader)
        assert instance.get_run_by_id(a_run.run_id).status == dg.DagsterRunStatus.STARTED
        a.kill()
        a.env.pop("GGUF_ASSETS_FAULT")
        a.start()  # the host comes back: the worker rejoins and takes work again
        assert leader.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()
    finally:
        if leader is not None and leader.poll() is None:
            leader.kill()
        for worker in (a, b):
            worker.stop()
    out = (tmp_path / "run.log").read_text()
    assert f"a worker died under run {a_run.run_id[:8]}" in out, out
    assert instance.get_run_by_id(a_run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert pipeline_outputs(paths.root) == reference_run[0]  # byte-identical to the single-machine run

    # Every run went through the workers' queues and names the worker that ran it; the restarted a took work.
    runs = instance.get_runs()
    workers_of = {r.run_id: _celery(servers[REDIS_ENV]).AsyncResult(r.tags["dagster-celery/task_id"]).worker
                  for r in runs if r.status == dg.DagsterRunStatus.SUCCESS}
    assert all(workers_of.values()), workers_of
    assert {name.split("@")[0] for name in workers_of.values()} == {"gguf-a", "gguf-b"}, workers_of
    assert {r.job_name for r in runs} == {"materials_and_corpus", "precompute_train_shards", "precompute_val_shards",
                                          "train_export_evaluate"}
    # One pipeline, one notice (#65), sent by the worker whose run scored the GGUF: the killed worker's run, whose
    # shards went back to the queue, was no end of the pipeline and is not told.
    ((_, notice),) = webhook.posts
    scored = next(r for r in runs if r.job_name == "train_export_evaluate")
    assert (notice["outcome"], notice["run_id"]) == ("finished", scored.run_id), notice
    report = json.loads((paths.root / "output" / "report.json").read_text())
    assert notice["val_centred_cosine"] == report["val_centred_cosine"] is not None, notice
    assert not (paths.dagster_home / "history" / "runs.db").exists()  # every record went to Postgres, none to SQLite
    # A second run finds everything current, from the records in Postgres: no new run.
    again = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(**servers),
                           timeout=300)
    assert again.returncode == 0 and len(instance.get_runs()) == len(runs), again.stdout + again.stderr

    # Nothing of a worker's: no URL, no mount path or folder, no host name, no worker name.
    secrets = [*servers.values(), str(tmp_path / "host-a"), str(tmp_path / "host-b"), "gguf-a@", "gguf-b@"]
    if len(socket.gethostname()) >= 6:
        secrets.append(socket.gethostname())
    for file in (f for f in paths.root.rglob("*") if f.is_file() and not f.is_symlink()):
        data = file.read_bytes()
        leaked = [s for s in secrets if s.encode() in data]
        assert not leaked, (file, leaked)


def _gguf_written(paths) -> bool:
    """The worker is at the export's stall: the GGUF is in its temp file (the point is after the write)."""
    try:
        return any(f.stat().st_size for f in paths.root.glob("output/.tmp-*.gguf.*"))
    except FileNotFoundError:  # renamed between the listing and the stat
        return False


RODE_OUT = "the cluster's Postgres answers again"  # what a process whose storage call rode out an outage says


def _outage(postgres: Path, redis, worker: Worker) -> None:
    """Postgres (an immediate stop, as a crash) and Redis (killed) go away, and come back once the worker's run has
    waited on Postgres for longer than dagster-postgres's own retries (about 6 s), which alone would fail it."""
    waited = worker.log.read_text().count("lost the connection to the cluster's Postgres")
    stop_postgres(postgres)
    redis.stop()
    try:
        wait_for(lambda: worker.log.read_text().count("lost the connection to the cluster's Postgres") > waited,
                 timeout=120, what="the worker's run to wait for Postgres")
        time.sleep(8)
    finally:
        start_postgres(postgres)
        redis.start()


def test_redis_and_postgres_restarts_then_ctrl_c_leave_the_run_going_and_the_next_run_finishes(
        make_project, reference_run, tmp_path, monkeypatch):
    """A crash and restart of the broker (its queue in an append-only file, as a broker's must be) and an immediate
    restart of Postgres while a worker computes shards: `run` keeps following. Then Ctrl-C: it stops following,
    says the run goes on, and the run does finish on the worker; the next `run` finishes the pipeline through two
    outages of both servers, one during the training and one during the GGUF export, each longer than
    dagster-postgres's own retries: byte-identical to a single-machine run."""
    import dagster as dg

    from gguf_assets.pipeline import run_tags

    with postgres_server(tmp_path / "postgres", free_port()) as pg, \
            redis_server(tmp_path / "redis", free_port(), persist=True) as redis:
        servers = {PG_ENV: pg, REDIS_ENV: redis.url}
        paths = make_project(**FAULT_SETTINGS)
        subprocess.run([*CLI, "cluster", str(paths.root), "--celery-broker-env", REDIS_ENV], capture_output=True,
                       env=cli_env(), timeout=60, check=True)
        # The 4th shard-half write (the second train shard) stalls 30 s: the restarts and the Ctrl-C land while the
        # worker is in the middle of the shards. In the next run, training step 11 stalls 3 s and the GGUF's write 8 s
        # (what is left after it, the evaluation, may take less than stopping Postgres on a loaded machine): the
        # outages begin there, and the run goes on into them.
        worker = Worker(tmp_path / "host-a", paths.root, servers, "gguf-a",
                        GGUF_ASSETS_FAULT="shard-write@4:stall:30,train-step@11:stall:3,gguf-export:stall:8").start()
        try:
            _wait_for_workers(redis.url, worker, timeout=120)
            for name, url in servers.items():
                monkeypatch.setenv(name, url)
            instance = project_instance(paths)
            with open(tmp_path / "run.log", "w") as out:
                leader = subprocess.Popen([*CLI, "run", str(paths.root)], stdout=out, stderr=subprocess.STDOUT,
                                          text=True, env=cli_env(**servers))

            def shard_run():
                return next((r for r in instance.get_runs(filters=dg.RunsFilter(
                    statuses=[dg.DagsterRunStatus.STARTED], job_name="precompute_train_shards"))
                    if run_tags.get(r.tags, run_tags.PID_TAG)), None)

            wait_for(lambda: shard_run() is not None, timeout=240, what="the worker at the train shards", proc=leader)
            running = shard_run()
            redis.restart()
            from servers import restart_postgres

            restart_postgres(tmp_path / "postgres")
            time.sleep(2)
            assert leader.poll() is None, (tmp_path / "run.log").read_text()  # still following
            leader.send_signal(signal.SIGINT)
            code = leader.wait(timeout=120)
            out = (tmp_path / "run.log").read_text()
            assert code == 130 and "Traceback" not in out, out
            assert f"stopped following; 1 run(s) go on on the workers ({running.run_id[:8]})" in out, out
            # The run goes on without anyone following it, and succeeds.
            wait_for(lambda: instance.get_run_by_id(running.run_id).status == dg.DagsterRunStatus.SUCCESS,
                     timeout=240, what="the run to finish on the worker")
            # The next run: the val shards, then training and the export, each through an outage of both servers.
            with open(tmp_path / "again.log", "w") as out:
                again = subprocess.Popen([*CLI, "run", str(paths.root)], stdout=out, stderr=subprocess.STDOUT,
                                         text=True, env=cli_env(**servers))
            for phase, reached in (("training", lambda: any(paths.root.glob("checkpoints/*/step-00000010/meta.json"))),
                                   ("export", lambda: _gguf_written(paths))):
                wait_for(reached, timeout=300, what=f"the worker in the {phase}", proc=again)
                _outage(tmp_path / "postgres", redis, worker)
            code = again.wait(timeout=600)
            out = (tmp_path / "again.log").read_text()
            assert code == 0 and "Traceback" not in out, out
            assert out.count(RODE_OUT) >= 2, out  # `run` itself waited for Postgres through both outages
        finally:
            worker.stop()
        assert worker.log.read_text().count(RODE_OUT) >= 2  # and so did the run on the worker
        assert "Traceback" not in worker.log.read_text()
        assert pipeline_outputs(paths.root) == reference_run[0]


# A Celery worker of the cluster's own app (its settings, its argv) with one task that sleeps.
SLEEPER = """
import sys, time
from gguf_assets.orchestration.cluster_workers import ClusterRunLauncher, worker_argv
app = ClusterRunLauncher(broker=sys.argv[1], backend=sys.argv[1], default_queue="gpu").celery
@app.task(name="sleep", track_started=True)
def sleep(seconds):
    time.sleep(seconds)
app.worker_main(worker_argv(queues=["gpu"], name="sleeper@%h"))
"""


def test_a_run_on_another_machine_is_judged_by_pinging_its_celery_worker(tmp_path):
    """The interrupted-runs check cannot use a pid from another machine: it asks the launcher, which pings the
    worker the task's state names. A live worker's run is left alone; after a kill -9 it is marked failed."""
    import dagster as dg
    from dagster_celery.tags import DAGSTER_CELERY_TASK_ID_TAG

    from gguf_assets.pipeline import run_tags
    from gguf_assets.pipeline.resume import mark_interrupted_runs

    with redis_server(tmp_path / "redis", free_port()) as redis:
        worker = subprocess.Popen([CLI[0], "-c", SLEEPER, redis.url], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: "sleeper" in _answering(redis.url), timeout=60, what="the worker", proc=worker)
            overrides = {"run_launcher": {"module": "gguf_assets.orchestration.cluster_workers",
                                          "class": "ClusterRunLauncher",
                                          "config": {"broker": redis.url, "backend": redis.url,
                                                     "default_queue": "gpu"}}}
            (tmp_path / "home").mkdir()
            with dg.DagsterInstance.local_temp(str(tmp_path / "home"), overrides=overrides) as instance:
                task = instance.run_launcher.celery.send_task("sleep", args=[120], queue="gpu")
                wait_for(lambda: task.state == "STARTED", timeout=60, what="the task to start")
                run = instance.create_run_for_job(dg.GraphDefinition("g").to_job(), tags={
                    DAGSTER_CELERY_TASK_ID_TAG: task.id, run_tags.MACHINE_TAG: "another-machine",
                    run_tags.PID_TAG: str(worker.pid)})  # a pid here, but the machine is another
                instance.handle_new_event(dg.EventLogEntry(
                    error_info=None, level="INFO", user_message="", run_id=run.run_id, timestamp=time.time(),
                    dagster_event=dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run.job_name)))
                assert mark_interrupted_runs(instance) == []  # its worker answers
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
                assert mark_interrupted_runs(instance) == [run.run_id]
                failure = instance.get_run_by_id(run.run_id)
                assert failure.status == dg.DagsterRunStatus.FAILURE
                assert run_tags.INTERRUPTED_TAG in failure.tags
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
