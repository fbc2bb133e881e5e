"""A project's cluster settings (<project>/cluster.yaml): where its Dagster instance keeps its records.

Without the file a project is its own embedded instance (SQLite in <project>/.dagster), the default.
With it, run, event-log and schedule storage go to Postgres (dagster-postgres), so several machines
and the UI share one record of the runs. The file names environment variables only, never a URL or a
password, and no path, so the folder can live on shared storage mounted anywhere. One database per
project: the shard partitions and the run history are the project's own.

With `celery_broker_env` as well, runs execute on Celery workers (`gguf-trainer worker DIR` on each
machine, orchestration/cluster_workers.py) through dagster-celery's run launcher, with a Redis broker and
result backend at the URL in that variable.

`gguf-trainer cluster DIR --postgres-url-env NAME [--celery-broker-env NAME]` writes it;
orchestration.instance.prepare_instance renders the instance config (<project>/.dagster/dagster.yaml) from it on every
start.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.pipeline.names import CPU_QUEUE, GPU_QUEUE, QUEUE_TAG, QUEUES  # noqa: F401 (cluster's names)

CLUSTER_FILE = "cluster.yaml"
DEFAULT_POSTGRES_URL_ENV = "GGUF_ASSETS_POSTGRES_URL"
DEFAULT_BROKER_URL_ENV = "GGUF_ASSETS_REDIS_URL"
# How long a cluster's Postgres or Redis may be away (a restart, a failover) before a storage call, or `run`
# following the workers, gives up with one line: orchestration/cluster_workers.py (the storage),
# orchestration/outages.py.
OUTAGE_S = 120.0
# The instance's storage classes on a cluster: dagster-postgres's, riding out a restart
# (orchestration/cluster_workers.py).
STORAGE_MODULE = "gguf_assets.orchestration.cluster_workers"
STORAGE_CLASSES = {"run_storage": "RidingOutRunStorage", "event_log_storage": "RidingOutEventLogStorage",
                   "schedule_storage": "RidingOutScheduleStorage"}
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class ClusterError(UserError):
    """cluster.yaml is invalid, or the environment it names is not set."""


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    postgres_url_env: str = Field(DEFAULT_POSTGRES_URL_ENV, description=(
        "environment variable that holds the Postgres URL (postgresql://user:password@host:5432/database); the URL "
        "itself is never written to the project"))
    celery_broker_env: str | None = Field(None, description=(
        "environment variable that holds the Redis URL (redis://[:password@]host:6379/0) of the Celery broker; set, "
        "runs execute on the workers that `gguf-trainer worker DIR` starts; unset, in the process that starts them"))

    @property
    def runs_on_workers(self) -> bool:
        """Whether runs execute on Celery workers (a broker is named), not in the process that starts them."""
        return self.celery_broker_env is not None


def cluster_file(project: Path) -> Path:
    return Path(project) / CLUSTER_FILE


def load_cluster(project: Path) -> ClusterSettings | None:
    """The project's cluster settings, or None for the embedded default."""
    file = cluster_file(project)
    if not file.is_file():
        return None
    try:
        doc = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        settings = ClusterSettings(**doc) if isinstance(doc, dict) else None
    except (yaml.YAMLError, ValidationError, TypeError) as exc:
        raise ClusterError(f"{file} is not valid: {str(exc).splitlines()[0]}. Write it again with "
                           "`gguf-trainer cluster DIR --postgres-url-env NAME`, or delete it for the embedded "
                           "single-machine instance.") from None
    if settings is None or not _ENV_NAME.match(settings.postgres_url_env):
        raise ClusterError(f"{file}: postgres_url_env must name an environment variable (like "
                           f"{DEFAULT_POSTGRES_URL_ENV}).")
    if settings.celery_broker_env is not None and not _ENV_NAME.match(settings.celery_broker_env):
        raise ClusterError(f"{file}: celery_broker_env must name an environment variable (like "
                           f"{DEFAULT_BROKER_URL_ENV}), or be left out for runs in the starting process.")
    return settings


def write_cluster(project: Path, settings: ClusterSettings) -> Path:
    file = cluster_file(project)
    header = ("# gguf_assets cluster settings: this project's Dagster records live in Postgres.\n"
              "# Delete this file to go back to the embedded single-machine instance (SQLite in .dagster).\n")
    atomic.write_text(file, header + yaml.safe_dump(settings.model_dump(exclude_none=True), sort_keys=False))
    return file


def instance_config(template: str, cluster: ClusterSettings | None) -> str:
    """The instance's dagster.yaml: the embedded template, with its storage moved to Postgres for a cluster."""
    if cluster is None:
        return template
    _need_env(cluster.postgres_url_env, "keeps its Dagster records in Postgres", "postgresql://user:password@"
              "host:5432/database")
    embedded = "storage:\n  sqlite:\n    base_dir:\n      env: DAGSTER_HOME\n"
    if embedded not in template:
        raise RuntimeError("the instance template's storage block changed; update cluster.instance_config")
    # dagster-postgres's storages, each a subclass that retries the calls a Postgres restart breaks (Dagster's own
    # retries cover only opening a connection, for about 6 s: docs/cluster.md).
    postgres = "".join(f"{key}:\n  module: {STORAGE_MODULE}\n  class: {name}\n  config:\n    postgres_url:\n"
                       f"      env: {cluster.postgres_url_env}\n" for key, name in STORAGE_CLASSES.items())
    config = template.replace(embedded, postgres)
    if cluster.runs_on_workers:
        _need_env(cluster.celery_broker_env, "runs its work on Celery workers, with the broker", "redis://host:6379/0")
        # The broker doubles as the result backend: the workers' task states are what the health check reads.
        config += ("# Runs execute on Celery workers (`gguf-trainer worker DIR`): docs/cluster.md.\n"
                   "run_launcher:\n  module: gguf_assets.orchestration.cluster_workers\n  class: ClusterRunLauncher\n"
                   f"  config:\n    broker:\n      env: {cluster.celery_broker_env}\n"
                   f"    backend:\n      env: {cluster.celery_broker_env}\n    default_queue: gpu\n")
    return config


def _need_env(name: str, what: str, example: str) -> None:
    if not os.environ.get(name):
        raise ClusterError(f"this project's {CLUSTER_FILE} {what} at the URL in ${name}, which is not set. Export it "
                           f"({example}), or delete {CLUSTER_FILE} for the embedded instance.")
