"""cluster.yaml and the instance config it renders: Postgres storage, and with a broker, the Celery run launcher.

Fast: nothing here talks to a server (test_cluster.py and test_cluster_workers.py do, with real ones).
"""

import pytest
import yaml

from gguf_assets.cli import main
from gguf_assets.orchestration.cluster import (
    ClusterError,
    ClusterSettings,
    instance_config,
    load_cluster,
    write_cluster,
)

TEMPLATE = "storage:\n  sqlite:\n    base_dir:\n      env: DAGSTER_HOME\ntelemetry:\n  enabled: false\n"


def test_the_file_names_variables_only_and_the_config_routes_runs_to_the_workers(tmp_path, monkeypatch):
    write_cluster(tmp_path, ClusterSettings(postgres_url_env="PG_URL", celery_broker_env="BROKER_URL"))
    text = (tmp_path / "cluster.yaml").read_text()
    assert "postgres_url_env: PG_URL" in text and "celery_broker_env: BROKER_URL" in text
    settings = load_cluster(tmp_path)
    monkeypatch.setenv("PG_URL", "postgresql://u:secret@db:5432/x")
    with pytest.raises(ClusterError, match=r"\$BROKER_URL, which is not set"):
        instance_config(TEMPLATE, settings)
    monkeypatch.setenv("BROKER_URL", "redis://:secret@broker:6379/0")
    config = instance_config(TEMPLATE, settings)
    assert "secret" not in config  # the config names the variables; Dagster reads them at start
    doc = yaml.safe_load(config)
    # dagster-postgres's storages, as subclasses that ride out a Postgres restart (the class each names exists).
    import importlib

    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    assert "storage" not in doc
    for key, base in (("run_storage", PostgresRunStorage), ("event_log_storage", PostgresEventLogStorage),
                      ("schedule_storage", PostgresScheduleStorage)):
        assert doc[key]["config"] == {"postgres_url": {"env": "PG_URL"}}
        assert issubclass(getattr(importlib.import_module(doc[key]["module"]), doc[key]["class"]), base)
    launcher = doc["run_launcher"]
    assert launcher["config"]["broker"] == {"env": "BROKER_URL"} == launcher["config"]["backend"]

    # The class the config names builds a real Celery app with the settings long runs need.
    from dagster_celery.launcher import CeleryRunLauncher

    cls = getattr(importlib.import_module(launcher["module"]), launcher["class"])
    built = cls(broker="redis://broker:6379/0", backend="redis://broker:6379/0", default_queue="gpu")
    assert isinstance(built, CeleryRunLauncher) and built.supports_check_run_worker_health
    conf = built.celery.conf
    assert conf.task_acks_late is True and conf.worker_prefetch_multiplier == 1 and conf.result_extended is True
    assert conf.broker_url == "redis://broker:6379/0"
    # A Redis restart: the worker reconnects for as long as it takes and its run goes on; a run is not handed out
    # again while it goes (a task unacknowledged for a week is still a run going, not a lost one).
    assert conf.broker_connection_max_retries is None
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is False
    assert conf.broker_transport_options["visibility_timeout"] >= 7 * 24 * 3600

    # Without a broker: Postgres storage only, runs in the starting process (no run launcher block).
    write_cluster(tmp_path, ClusterSettings(postgres_url_env="PG_URL"))
    assert "celery_broker_env" not in (tmp_path / "cluster.yaml").read_text()
    assert "run_launcher" not in yaml.safe_load(instance_config(TEMPLATE, load_cluster(tmp_path)))


def test_a_bad_variable_name_names_the_file(tmp_path):
    (tmp_path / "cluster.yaml").write_text("postgres_url_env: PG_URL\ncelery_broker_env: redis://host:6379\n")
    with pytest.raises(ClusterError, match=r"cluster.yaml: celery_broker_env must name an environment variable"):
        load_cluster(tmp_path)


def test_worker_refuses_a_project_without_workers_and_unknown_queues(tmp_path, capsys, monkeypatch):
    project = tmp_path / "p"
    assert main(["init", str(project)]) == 0
    assert main(["worker", str(project)]) == 2
    said = capsys.readouterr().err
    assert "runs its work in the process that starts it" in said and "--celery-broker-env" in said, said
    write_cluster(project, ClusterSettings(postgres_url_env="PG_URL", celery_broker_env="BROKER_URL"))
    assert main(["worker", str(project), "--queues", "gpu,tpu"]) == 2
    said = capsys.readouterr().err
    assert "--queues gpu,tpu" in said and "gpu, cpu" in said, said
