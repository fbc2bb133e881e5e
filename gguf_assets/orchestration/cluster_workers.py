"""A cluster's workers: Dagster runs executed by Celery workers (dagster-celery's run launcher, Redis broker).

Why the run launcher and not dagster-celery's executor: a shard job is one step over a range of
shard partitions (a single-run backfill), so a Celery task per step would add a hop and nothing
else, and the run's own process would stay on the machine that submitted it. With the run launcher
a whole run is one Celery task, and the worker that takes it executes it in its own process, as
`gguf-trainer run` does locally: the run's pid and machine tags, its lock and its records are the
worker's. Dagster's Terminate (a Celery revoke) and run monitoring's worker health check come with
it.

Queues: `gpu` (precompute and training) and `cpu` (materials and corpus). Each job names its queue
in its tags (defs/jobs.py), so a run launched from the UI lands where `gguf-trainer run` puts it.
A worker runs one run at a time (concurrency 1, one worker per GPU), in a fresh child process per
run, so a run's models and GPU memory leave with it.

The cluster's storage lives here too (the instance config names these classes, cluster.STORAGE_CLASSES):
dagster-postgres's run, event-log and schedule storages, each a subclass whose calls ride out a
Postgres restart. dagster-postgres opens a fresh connection per call (NullPool) and retries only the
opening, about 6 s in all; a statement in flight when the server goes ("server closed the connection
unexpectedly") fails at once, and a restart that keeps the server away longer fails too. In a run that
is a failed step or run (a log line or an observation is an event write), so here every storage call
is retried on a lost connection for up to cluster.OUTAGE_S, and the writes that are not idempotent are
made so: an event whose insert went through before the connection broke is not stored twice, and a
run's tags are completed rather than left half written.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import sqlalchemy as db
import sqlalchemy.exc
from dagster_celery.config import DEFAULT_CONFIG
from dagster_celery.launcher import CeleryRunLauncher
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage
from dagster_postgres.utils import DagsterPostgresException, get_token_provider_from_config, pg_url_from_config

from gguf_assets.orchestration.cluster import OUTAGE_S, QUEUE_TAG, STORAGE_CLASSES
from gguf_assets.pipeline.private_api import (
    ASSET_CHECK_EVENTS,
    ASSET_EVENTS,
    CheckRunHealthResult,
    RunTagsTable,
    SqlEventLogStorageTable,
    WorkerStatus,
    serialize_value,
)

assert QUEUE_TAG == DAGSTER_CELERY_QUEUE_TAG, "dagster-celery renamed its queue tag: update orchestration/cluster.py"
PING_TIMEOUT_S = 5.0

# Celery settings for runs that take hours. Late acknowledgement with a prefetch of one: a worker
# busy with a run reserves no second one (which a kill -9 would strand until the broker's
# visibility timeout). A run redelivered after its worker died is ignored by Dagster, which never
# starts a run twice; the pipeline plans the dead run's shards again instead.
CELERY_SETTINGS = {
    "task_acks_late": True,
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    "result_expires": 7 * 24 * 3600,
    "result_extended": True,  # a finished task's state names the worker that ran it (get_run_worker_debug_info)
    # A Redis restart: the worker reconnects for as long as it takes (Celery's default gives up after 100 tries and
    # the worker exits), and the run it executes goes on (Celery 6 will cancel it by default instead).
    "broker_connection_max_retries": None,
    "worker_cancel_long_running_tasks_on_connection_loss": False,
    # Redis hands out again a task unacknowledged for this long; with late acknowledgement that is a run still
    # going (training takes hours, the default is 1 h). A second delivery is dropped anyway (_execute_job_task),
    # but it would hold a free worker for nothing: longer than any run. (dagster-celery's publish retries kept.)
    "broker_transport_options": {**DEFAULT_CONFIG["broker_transport_options"], "visibility_timeout": 30 * 24 * 3600},
}


class ClusterRunLauncher(CeleryRunLauncher):
    """dagster-celery's run launcher, with a worker health check that notices a worker that died.

    Celery's own state of a task whose worker was killed stays STARTED for ever; so for a STARTED
    run the worker that took it (named in the task's state) is pinged, and one that does not answer
    is reported FAILED, which run monitoring and the interrupted-runs check act on.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["config_source"] = {**CELERY_SETTINGS, **(kwargs.get("config_source") or {})}
        super().__init__(*args, **kwargs)

    def launch_run(self, context) -> None:
        # dagster-celery registers its task again at every launch, and Celery warns each time after the first.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Task name 'execute_job' is already registered")
            super().launch_run(context)

    def check_run_worker_health(self, run) -> CheckRunHealthResult:
        if DAGSTER_CELERY_TASK_ID_TAG not in run.tags:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "not handed to Celery yet")
        try:
            return self._check_health(run)
        except broker_errors():  # restarting: no verdict now (the next check gives one), and no failed check either
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "the broker does not answer")

    def _check_health(self, run) -> CheckRunHealthResult:
        health = super().check_run_worker_health(run)
        if health.status != WorkerStatus.RUNNING:
            return health
        result = self.celery.AsyncResult(run.tags[DAGSTER_CELERY_TASK_ID_TAG])
        worker = (result.info or {}).get("hostname") if isinstance(result.info, dict) else None
        if worker and not self.celery.control.ping(destination=[worker], timeout=PING_TIMEOUT_S):
            return CheckRunHealthResult(WorkerStatus.FAILED, f"Celery worker {worker} does not answer")
        return health

    def live_workers(self, queue: str) -> list[str]:
        """The workers that answer now and take runs from ``queue``."""
        answers = self.celery.control.inspect(timeout=PING_TIMEOUT_S).active_queues() or {}
        return sorted(name for name, queues in answers.items() if any(q.get("name") == queue for q in queues))


def broker_errors() -> tuple[type[BaseException], ...]:
    """What the Celery broker and result backend raise while Redis is away (restarting, unreachable)."""
    import kombu.exceptions
    import redis.exceptions

    return kombu.exceptions.OperationalError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError


def worker_argv(*, queues: list[str], name: str, loglevel: str = "WARNING") -> list[str]:
    """Celery's worker command line: one run at a time, each in a fresh child process."""
    return ["worker", "--queues", ",".join(queues), "--concurrency", "1", "--prefetch-multiplier", "1",
            "--max-tasks-per-child", "1", "--hostname", name, "--loglevel", loglevel, "--without-gossip"]


def serve_runs(instance, *, queues: list[str], name: str) -> None:
    """Take runs from ``queues`` and execute them, until stopped (Ctrl-C or SIGTERM finishes the current run)."""
    from dagster_celery.tasks import create_resume_job_task

    app = instance.run_launcher.celery
    _execute_job_task(app)
    create_resume_job_task(app)
    app.worker_main(worker_argv(queues=queues, name=name))


CLAIMS_DIR = "run-claims"  # in the instance's folder (<project>/.dagster, shared): one flock per run being executed


def _execute_job_task(app):
    """dagster-celery's run task (the same name and arguments), taking each run at most once.

    The broker may deliver a run's task a second time: kombu puts a worker's unacknowledged tasks back in the
    queue when its connection to Redis breaks (a restart), and Redis hands out again one unacknowledged for
    longer than its visibility timeout. Dagster ignores a second run worker for a finished run, but one for a
    run still going it marks failed ("started a new run worker while the run was already in state STARTED"),
    though the first worker is computing it. So here a run is executed only by the worker that claims it (a
    flock on the shared folder, held by the run's process until it ends, also a kill -9) and only from
    NOT_STARTED or STARTING; any other delivery is dropped with one line in the worker's log. A run whose
    worker died is the interrupted-runs check's to mark, and `run` plans its work again."""
    import fcntl
    import os
    from pathlib import Path

    import dagster as dg
    from celery import states
    from celery.exceptions import Ignore
    from dagster_celery.config import TASK_EXECUTE_JOB_NAME

    from gguf_assets.pipeline.private_api import ExecuteRunArgs, _execute_run_command_body, unpack_value

    startable = (dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING)

    # Not track_started: a dropped delivery must leave the task's state alone (it names the worker the health check
    # pings), so STARTED is stored here, as Celery would, only once this worker has the run; a drop raises Ignore.
    @app.task(bind=True, name=TASK_EXECUTE_JOB_NAME)
    def execute_job(task, execute_job_args_packed) -> int:
        args = unpack_value(execute_job_args_packed, as_type=ExecuteRunArgs)
        with dg.DagsterInstance.get() as instance:
            claims = Path(instance.root_directory) / CLAIMS_DIR
            claims.mkdir(parents=True, exist_ok=True)
            claim = os.open(claims / args.run_id, os.O_CREAT | os.O_RDWR, 0o644)  # this process's until it ends
            try:
                fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(f"run {args.run_id[:8]}: its task came again while a worker executes it; this delivery is "
                     "dropped")
                raise Ignore() from None
            run = instance.get_run_by_id(args.run_id)
            if run is not None and run.status not in startable:
                _say(f"run {args.run_id[:8]} is {run.status.value.lower()} already; this delivery of its task is "
                     "dropped")
                raise Ignore()
            task.backend.store_result(task.request.id, {"pid": os.getpid(), "hostname": task.request.hostname},
                                      states.STARTED, request=task.request)
            return _execute_run_command_body(
                instance=instance, run_id=args.run_id, write_stream_fn=lambda _event: None,
                set_exit_code_on_failure=args.set_exit_code_on_failure is not False)

    return execute_job


# ---------------------------------------------------------------------------------------------------------------
# Storage that rides out a Postgres restart

T = TypeVar("T")
RETRY_WAIT_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # then every 5 s, until OUTAGE_S
_CONNECTION_CLASSES = ("08", "57P01", "57P02", "57P03")  # SQLSTATE: connection exception; the server shutting down
_state = threading.local()  # .depth: storage calls in progress in this thread (nested calls do not retry)


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection to Postgres is gone (a restart), not that a statement was wrong."""
    if isinstance(exc, DagsterPostgresException):  # dagster-postgres's own connect retries gave up
        return exc.__cause__ is not None and connection_lost(exc.__cause__)
    if isinstance(exc, sqlalchemy.exc.InterfaceError):  # "connection already closed"
        return True
    if not isinstance(exc, sqlalchemy.exc.DBAPIError):
        return False
    if exc.connection_invalidated:  # SQLAlchemy's own judgement: a disconnect
        return True
    code = getattr(exc.orig, "pgcode", None)
    # No SQLSTATE at all: the client's own error (refused, reset, closed), not a server's verdict on a statement.
    return isinstance(exc, sqlalchemy.exc.OperationalError) and (code is None or code.startswith(_CONNECTION_CLASSES))


def reason(exc: BaseException) -> str:
    """The error's first line, without the server's address (it may land in a run's compute log)."""
    cause = exc.__cause__ if isinstance(exc, DagsterPostgresException) and exc.__cause__ else exc
    text = str(getattr(cause, "orig", None) or cause).strip().splitlines()
    return re.sub(r"connection to server at .*? failed: ", "", text[0]) if text else type(cause).__name__


def ride_out(call: Callable[[bool], T], what: str) -> T:
    """``call(again)``, called again (``again`` true) while Postgres is away, for up to OUTAGE_S; then the error.

    Only the outermost storage call of a thread retries: a call made inside another one fails through to it,
    so one outage is one wait, and the outer call starts over whole."""
    if getattr(_state, "depth", 0):
        return call(False)
    _state.depth = 1
    began, attempt = None, 0
    try:
        while True:
            try:
                answer = call(attempt > 0)
            except Exception as exc:
                if not connection_lost(exc):
                    raise
                now = time.monotonic()
                if began is None:
                    began = now
                    _say(f"lost the connection to the cluster's Postgres ({reason(exc)}) in {what}; trying again "
                         f"for up to {OUTAGE_S:.0f} s")
                elif now - began > OUTAGE_S:
                    _say(f"the cluster's Postgres has not answered for {OUTAGE_S:.0f} s; giving up")
                    raise
                time.sleep(RETRY_WAIT_S[attempt] if attempt < len(RETRY_WAIT_S) else 5.0)
                attempt += 1
                continue
            if began is not None:
                _say(f"the cluster's Postgres answers again, after {time.monotonic() - began:.0f} s")
            return answer
    finally:
        _state.depth = 0


def _say(line: str) -> None:
    # stderr, not logging: inside a run the gguf_assets loggers write to the event log, which is what is away.
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _connection(engine) -> Iterator:
    """A connection without dagster-postgres's own connect retries (ride_out retries the whole call, and says so
    once, instead of a multi-line warning per attempt)."""
    conn = engine.connect()
    try:
        yield conn
    finally:
        conn.close()


# Public methods that are not storage calls: connections and transactions (the error comes later, in the caller's
# block), watchers, the instance's lifecycle and schema migrations.
_NOT_RETRIED = frozenset({
    "connect", "run_connection", "index_connection", "index_transaction", "watch", "end_watch", "dispose",
    "register_instance", "optimize_for_webserver", "upgrade", "migrate", "optimize", "reindex_events",
    "reindex_assets", "prepare_insert_event", "prepare_insert_event_batch"})


def _riding_out(cls: type) -> type:
    """Every public storage method of ``cls`` (inherited ones too) through ride_out, except those it defines itself."""
    for name in dir(cls):
        if name.startswith("_") or name in _NOT_RETRIED or name in vars(cls):
            continue
        member = inspect.getattr_static(cls, name)
        if not inspect.isfunction(member) or inspect.isgeneratorfunction(inspect.unwrap(member)):
            continue  # properties, static and class methods, generators and context managers

        def retried(self, *args, _method=member, **kwargs):
            return ride_out(lambda _again: _method(self, *args, **kwargs), _method.__name__)

        setattr(cls, name, functools.wraps(member)(retried))
    return cls


class _RidingOut:
    """What the three storages share: construction (the table check) rides out too, and the class it builds is
    this one (dagster-postgres's from_config_value names its own), so an instance ref names it as well."""

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return ride_out(lambda _again: cls(inst_data=inst_data, postgres_url=pg_url_from_config(config_value),
                                           should_autocreate_tables=config_value.get("should_autocreate_tables",
                                                                                     True),
                                           token_provider=get_token_provider_from_config(config_value)),
                        "opening the storage")


@_riding_out
class RidingOutEventLogStorage(_RidingOut, PostgresEventLogStorage):
    def _connect(self):  # run_connection and index_connection come here too
        return _connection(self._engine)

    def store_event(self, event) -> None:
        ride_out(lambda again: self._store_event(event, again), "store_event")

    def store_event_batch(self, events) -> None:
        # Dagster writes batches only with DAGSTER_EVENT_BATCH_SIZE set. Once broken, the batch goes one by one,
        # each event checked for having gone in already.
        def once(again: bool) -> None:
            if not again:
                return PostgresEventLogStorage.store_event_batch(self, events)
            for event in events:
                self._store_event(event, again=True)

        ride_out(once, "store_event_batch")

    def _store_event(self, event, again: bool) -> None:
        stored = self._stored_event_id(event) if again else None
        if stored is None:
            PostgresEventLogStorage.store_event(self, event)
            return
        # The insert went through before the connection broke (its NOTIFY, or the asset index, did not): what
        # store_event does after the insert, done again (upserts, in one transaction).
        if event.is_dagster_event and event.dagster_event_type in ASSET_EVENTS and event.dagster_event.asset_key:
            with self.index_transaction() as conn:
                self._store_asset_event_tags(conn, [event], [stored])
                self._store_asset_event(conn, event, stored)
        if event.is_dagster_event and event.dagster_event_type in ASSET_CHECK_EVENTS:
            self.store_asset_check_event(event, stored)

    def _stored_event_id(self, event) -> int | None:
        table = SqlEventLogStorageTable
        query = (db.select(table.c.id).where(table.c.run_id == event.run_id, table.c.event == serialize_value(event))
                 .order_by(table.c.id.desc()).limit(1))
        with self._connect() as conn:
            row = conn.execute(query).fetchone()
        return int(row[0]) if row is not None else None


@_riding_out
class RidingOutRunStorage(_RidingOut, PostgresRunStorage):
    def connect(self):
        return _connection(self._engine)

    def add_run(self, dagster_run):
        return ride_out(lambda again: self._add_run(PostgresRunStorage.add_run, dagster_run, again), "add_run")

    def add_historical_run(self, dagster_run, run_creation_time):
        return ride_out(lambda again: self._add_run(
            lambda storage, run: PostgresRunStorage.add_historical_run(storage, run, run_creation_time),
            dagster_run, again), "add_historical_run")

    def _add_run(self, add, dagster_run, again: bool):
        if again and self.has_run(dagster_run.run_id):  # the row went in before the connection broke
            self._complete_tags(dagster_run.run_id, dagster_run.tags_for_storage())
            return dagster_run
        return add(self, dagster_run)

    def add_run_tags(self, run_id: str, new_tags) -> None:
        def once(again: bool) -> None:
            PostgresRunStorage.add_run_tags(self, run_id, new_tags)
            if again:  # a first try may have updated the run's body but not its tag rows; this one saw them as set
                self._complete_tags(run_id, new_tags)

        ride_out(once, "add_run_tags")

    def _complete_tags(self, run_id: str, tags) -> None:
        """The run's tag rows hold ``tags``: the missing ones added, the others set."""
        table = RunTagsTable
        with self.connect() as conn:
            have = dict(conn.execute(db.select(table.c.key, table.c.value).where(
                table.c.run_id == run_id, table.c.key.in_(list(tags)))).fetchall())
            missing = [dict(run_id=run_id, key=key, value=value) for key, value in tags.items() if key not in have]
            if missing:
                conn.execute(table.insert(), missing)
            for key, value in tags.items():
                if key in have and have[key] != value:
                    conn.execute(table.update().where(table.c.run_id == run_id, table.c.key == key)
                                 .values(value=value))


@_riding_out
class RidingOutScheduleStorage(_RidingOut, PostgresScheduleStorage):
    def connect(self, run_id: str | None = None):
        return _connection(self._engine)


assert set(STORAGE_CLASSES.values()) == {"RidingOutRunStorage", "RidingOutEventLogStorage", "RidingOutScheduleStorage"}
