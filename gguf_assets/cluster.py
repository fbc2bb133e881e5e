"""A project's cluster settings (<project>/cluster.yaml): where its Dagster instance keeps its records.

Without the file a project is its own embedded instance (SQLite in <project>/.dagster), the default.
With it, run, event-log and schedule storage go to Postgres (dagster-postgres), so several machines
and the UI share one record of the runs. The file names environment variables only, never a URL or a
password, and no path, so the folder can live on shared storage mounted anywhere. One database per
project: the shard partitions and the run history are the project's own.

`gguf-trainer cluster DIR --postgres-url-env NAME` writes it; runner.prepare_instance renders the
instance config (<project>/.dagster/dagster.yaml) from it on every start.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError

CLUSTER_FILE = "cluster.yaml"
DEFAULT_POSTGRES_URL_ENV = "GGUF_ASSETS_POSTGRES_URL"
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class ClusterError(UserError):
    """cluster.yaml is invalid, or the environment it names is not set."""


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    postgres_url_env: str = Field(DEFAULT_POSTGRES_URL_ENV, description=(
        "environment variable that holds the Postgres URL (postgresql://user:password@host:5432/database); the URL "
        "itself is never written to the project"))


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
    return settings


def write_cluster(project: Path, settings: ClusterSettings) -> Path:
    file = cluster_file(project)
    header = ("# gguf_assets cluster settings: this project's Dagster records live in Postgres.\n"
              "# Delete this file to go back to the embedded single-machine instance (SQLite in .dagster).\n")
    atomic.write_text(file, header + yaml.safe_dump(settings.model_dump(), sort_keys=False))
    return file


def instance_config(template: str, cluster: ClusterSettings | None) -> str:
    """The instance's dagster.yaml: the embedded template, with its storage moved to Postgres for a cluster."""
    if cluster is None:
        return template
    if not os.environ.get(cluster.postgres_url_env):
        raise ClusterError(f"this project's {CLUSTER_FILE} keeps its Dagster records in Postgres, at the URL in "
                           f"${cluster.postgres_url_env}, which is not set. Export it (postgresql://user:password@"
                           f"host:5432/database), or delete {CLUSTER_FILE} for the embedded instance.")
    embedded = "storage:\n  sqlite:\n    base_dir:\n      env: DAGSTER_HOME\n"
    if embedded not in template:
        raise RuntimeError("the instance template's storage block changed; update cluster.instance_config")
    postgres = f"storage:\n  postgres:\n    postgres_url:\n      env: {cluster.postgres_url_env}\n"
    return template.replace(embedded, postgres)
