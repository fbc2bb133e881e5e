"""Every use of Dagster's private API (``dagster._…``) in gguf_assets, in one place, each with why.

Dagster 1.13 has no public API for these; a test (test_definitions.py) fails on a ``dagster._``
import anywhere else, so this list is the whole of what a Dagster upgrade must check, and it is
why pyproject.toml pins ``dagster<1.14``.

- ``JobSubsetSelector``, ``InProcessCodeLocationOrigin``, ``LoadableTargetOrigin``,
  ``WorkspaceProcessContext``, ``InProcessWorkspaceLoadTarget``, ``ModuleTarget``: `gguf-trainer
  run` creates each run from the project's code location (the public ``execute_job`` creates it
  from a bare job), so the run carries the location's origin; only then do the UI's Overview
  timeline, job pages and "Re-execute" show it.
- ``execute_run``, ``recon_job_from_origin``: execute such a run in this process (the public
  ``execute_job`` creates a run of its own). In-process execution makes a run one process from
  start to end: its pid identifies it to the interrupted-runs sensor, and GPU work never runs in
  a child that outlives a killed worker.
- ``LOG_RECORD_METADATA_ATTR``: the log record attribute holding its Dagster event (step key,
  error), which the console logger's short lines read; a logger only gets the formatted message.
- ``DATA_VERSION_TAG``: a runless observation carries its data version in this tag:
  ``report_runless_asset_event`` takes an AssetObservation, which has no data_version argument
  (ObserveResult, which has one, exists only inside a run).
- ``CODE_VERSION_TAG``, ``DATA_VERSION_IS_USER_PROVIDED_TAG``, ``INPUT_DATA_VERSION_TAG_PREFIX``,
  ``INPUT_EVENT_POINTER_TAG_PREFIX``, ``get_input_data_version_tag``, ``get_input_event_pointer_tag``:
  `gguf-trainer runs --use` makes a finished run's results current again without a run; the runless
  materializations it records for them (orchestration/runs.py ``record_made_current``) carry the provenance a run's
  would (its inputs' data versions and events), so the UI's stale marks agree with `status`
  (``report_runless_asset_event`` takes no provenance argument).
- ``HIDDEN_TAG_PREFIX``, ``TagType``, ``get_tag_type``: run tags under Dagster's hidden prefix are
  left out of the UI's runs list and run page, where the project's bookkeeping tags belong
  (run_tags.py).
- ``CachingStaleStatusResolver``, ``StaleStatus``, ``LoadingContextForTest``: the tests read the
  UI's stale marks with the resolver the webserver draws them with.
- ``ASSET_EVENTS``, ``ASSET_CHECK_EVENTS``, ``SqlEventLogStorageTable``, ``RunTagsTable``,
  ``serialize_value``: the cluster's Postgres storage rides out a restart (orchestration/cluster_workers.py): an event
  whose insert went through before the connection broke is found by its serialized body and not stored twice,
  with only its asset index redone; a run's tag rows that a broken first try left half written are completed.
  dagster-postgres has no retry of its own past opening a connection (docs/cluster.md).
- ``DagsterGrpcClient``: `ui` and `auto-resume` stop the project's one code server (cli/services.py CodeServer) by
  its ShutdownServer call, as dagster-webserver and dagster-daemon stop the code servers they start: a Dagster code
  server does not end on SIGTERM or SIGINT (it waits for a termination event that only that call or a heartbeat
  timeout sets; measured: still running 10 s after SIGTERM, gone 4 s after the call).
- ``_execute_run_command_body``, ``ExecuteRunArgs``, ``unpack_value``: the cluster worker's task executes a
  run as dagster-celery's own task does, but only once per run (a second delivery of the task by the broker is
  dropped), which needs the same body dagster-celery calls. ``pack_value``: its test redelivers a task as the
  launcher packs it.
- ``CheckRunHealthResult``, ``WorkerStatus``: a run launcher's worker health check (run monitoring's
  own interface), which the cluster's launcher answers (orchestration/cluster_workers.py) and the
  interrupted-runs check asks about a run on another machine (pipeline/resume.py).
- The ``create_engine`` that Dagster's SQLite storage modules call (``reuse_sqlite_engines``): they make a new
  SQLAlchemy engine for every connection (and SQLAlchemy sets up a new engine's dialect on its first connect),
  about a fifth of what a run's events cost; each process keeps one engine per database file instead, as Dagster's
  own Postgres storage keeps one engine.
"""

import os
import threading
from collections import OrderedDict

from dagster._cli.api import _execute_run_command_body
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    INPUT_DATA_VERSION_TAG_PREFIX,
    INPUT_EVENT_POINTER_TAG_PREFIX,
    CachingStaleStatusResolver,
    StaleStatus,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.events import ASSET_CHECK_EVENTS, ASSET_EVENTS
from dagster._core.execution.api import execute_run
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.loader import LoadingContextForTest
from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.storage.event_log import SqlEventLogStorageTable
from dagster._core.storage.event_log.sqlite import consolidated_sqlite_event_log, sqlite_event_log
from dagster._core.storage.runs.schema import RunTagsTable
from dagster._core.storage.runs.sqlite import sqlite_run_storage
from dagster._core.storage.schedules.sqlite import sqlite_schedule_storage
from dagster._core.storage.tags import HIDDEN_TAG_PREFIX, TagType, get_tag_type
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget, ModuleTarget
from dagster._grpc.client import DagsterGrpcClient
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import pack_value, serialize_value, unpack_value
from dagster._utils.hosted_user_process import recon_job_from_origin
from sqlalchemy.pool import NullPool

__all__ = [
    "DagsterGrpcClient",
    "ASSET_CHECK_EVENTS", "ASSET_EVENTS", "ExecuteRunArgs", "RunTagsTable", "SqlEventLogStorageTable",
    "_execute_run_command_body", "pack_value", "serialize_value", "unpack_value",
    "CODE_VERSION_TAG", "DATA_VERSION_IS_USER_PROVIDED_TAG", "DATA_VERSION_TAG", "INPUT_DATA_VERSION_TAG_PREFIX",
    "INPUT_EVENT_POINTER_TAG_PREFIX", "get_input_data_version_tag",
    "get_input_event_pointer_tag", "HIDDEN_TAG_PREFIX", "LOG_RECORD_METADATA_ATTR", "CachingStaleStatusResolver",
    "CheckRunHealthResult", "WorkerStatus",
    "InProcessCodeLocationOrigin", "InProcessWorkspaceLoadTarget", "JobSubsetSelector", "LoadableTargetOrigin",
    "LoadingContextForTest", "ModuleTarget", "StaleStatus", "TagType", "WorkspaceProcessContext", "execute_run",
    "get_tag_type", "recon_job_from_origin", "reuse_sqlite_engines",
]

# Dagster's SQLite storage modules, each of which calls its module's ``create_engine`` for every connection.
SQLITE_STORAGE_MODULES = (sqlite_event_log, consolidated_sqlite_event_log, sqlite_run_storage, sqlite_schedule_storage)
ENGINES_KEPT = 64  # per process: the instance's index, runs and schedules files, and the run shards lately read


class _EngineCache:
    """One SQLAlchemy engine per (database URL, options) in this process, the least lately used dropped past
    ENGINES_KEPT. Only for Dagster's calls with ``poolclass=NullPool``: such an engine holds no connection between
    uses (each use opens its own, as before), so sharing it between threads, storage objects and a fork's child
    changes nothing but the cost of making it."""

    def __init__(self, create_engine) -> None:
        self.create_engine = create_engine  # SQLAlchemy's own
        self._engines: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, url, **options):
        if options.get("poolclass") is not NullPool:
            return self.create_engine(url, **options)
        key = (str(url), repr(sorted(options.items())))
        with self._lock:
            engine = self._engines.get(key)
            if engine is not None:
                self._engines.move_to_end(key)
                return engine
        engine = self.create_engine(url, **options)
        with self._lock:
            engine = self._engines.setdefault(key, engine)  # another thread's, had it made one meanwhile
            while len(self._engines) > ENGINES_KEPT:
                self._engines.popitem(last=False)
        return engine

    def forget_after_fork(self) -> None:
        """In a forked child: no engines, and a new lock (another thread of the parent may have held the old one)."""
        self._engines, self._lock = OrderedDict(), threading.Lock()


_ENGINE_CACHE: _EngineCache | None = None


def _forget_engines() -> None:
    if _ENGINE_CACHE is not None:
        _ENGINE_CACHE.forget_after_fork()


os.register_at_fork(after_in_child=_forget_engines)  # a forked child makes its own (nothing is shared anyway)


def reuse_sqlite_engines() -> None:
    """Make Dagster's SQLite storage in this process keep its engines (see the module docstring); idempotent. Every
    process that opens a project's SQLite instance calls it first: gguf-trainer's commands (prepare_instance), the
    definitions (code servers, Dagster's run processes, the Dagster CLI) and the webserver."""
    global _ENGINE_CACHE
    if _ENGINE_CACHE is None:
        from sqlalchemy import create_engine

        _ENGINE_CACHE = _EngineCache(create_engine)
    for module in SQLITE_STORAGE_MODULES:
        module.create_engine = _ENGINE_CACHE
