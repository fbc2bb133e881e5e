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
- ``_execute_run_command_body``, ``ExecuteRunArgs``, ``unpack_value``: the cluster worker's task executes a
  run as dagster-celery's own task does, but only once per run (a second delivery of the task by the broker is
  dropped), which needs the same body dagster-celery calls. ``pack_value``: its test redelivers a task as the
  launcher packs it.
- ``CheckRunHealthResult``, ``WorkerStatus``: a run launcher's worker health check (run monitoring's
  own interface), which the cluster's launcher answers (orchestration/cluster_workers.py) and the
  interrupted-runs check asks about a run on another machine (orchestration/resume.py).
"""

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
from dagster._core.storage.runs.schema import RunTagsTable
from dagster._core.storage.tags import HIDDEN_TAG_PREFIX, TagType, get_tag_type
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget, ModuleTarget
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import pack_value, serialize_value, unpack_value
from dagster._utils.hosted_user_process import recon_job_from_origin

__all__ = [
    "ASSET_CHECK_EVENTS", "ASSET_EVENTS", "ExecuteRunArgs", "RunTagsTable", "SqlEventLogStorageTable",
    "_execute_run_command_body", "pack_value", "serialize_value", "unpack_value",
    "CODE_VERSION_TAG", "DATA_VERSION_IS_USER_PROVIDED_TAG", "DATA_VERSION_TAG", "INPUT_DATA_VERSION_TAG_PREFIX",
    "INPUT_EVENT_POINTER_TAG_PREFIX", "get_input_data_version_tag",
    "get_input_event_pointer_tag", "HIDDEN_TAG_PREFIX", "LOG_RECORD_METADATA_ATTR", "CachingStaleStatusResolver",
    "CheckRunHealthResult", "WorkerStatus",
    "InProcessCodeLocationOrigin", "InProcessWorkspaceLoadTarget", "JobSubsetSelector", "LoadableTargetOrigin",
    "LoadingContextForTest", "ModuleTarget", "StaleStatus", "TagType", "WorkspaceProcessContext", "execute_run",
    "get_tag_type", "recon_job_from_origin",
]
