"""The cluster's Dagster storage in a real PostgreSQL server (dagster-postgres), on loopback: its calls ride out
restarts and cut connections, and store each event once. The whole pipeline on Postgres (with Celery workers, Redis
and restarts) is test_cluster_workers.py's."""

import pytest
from conftest import free_port
from servers import postgres_server

pytestmark = pytest.mark.slow  # a database server, restarted

URL_ENV = "GGUF_ASSETS_POSTGRES_URL"


def _disconnect_once_before(engine, prefix: str, url: str, fired: list) -> None:
    """The first statement on ``engine`` that starts with ``prefix`` finds its connection cut by the server
    (pg_terminate_backend, as a restart does to every session): the statements before it went through."""
    import psycopg2
    from sqlalchemy import event

    def before(conn, _cursor, statement, *_args):
        if statement.lstrip().upper().startswith(prefix) and not fired:
            fired.append(statement)
            with psycopg2.connect(url) as admin, admin.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", (conn.connection.dbapi_connection.get_backend_pid(),))

    event.listen(engine, "before_cursor_execute", before)


def test_storage_calls_ride_out_postgres_restarts_and_store_each_event_once(tmp_path, monkeypatch, capfd):
    """The cluster's storage (the classes the instance config names) under real disconnects. First, surgical ones:
    an event's insert goes through and the connection is cut before its NOTIFY, a run's tags reach its body and
    the connection is cut before their rows; the event is stored once and the tag rows are complete. Then a stream
    of event and tag writes through immediate restarts (statements in flight) and one outage longer than
    dagster-postgres's own connect retries (about 6 s): every call succeeds, every event is stored once."""
    import threading
    import time

    import dagster as dg
    from servers import restart_postgres, start_postgres, stop_postgres

    from gguf_assets.orchestration.cluster import ClusterSettings, instance_config

    with postgres_server(tmp_path / "postgres", free_port()) as url:
        monkeypatch.setenv(URL_ENV, url)
        home = tmp_path / "home"
        home.mkdir()
        template = "storage:\n  sqlite:\n    base_dir:\n      env: DAGSTER_HOME\n"
        (home / "dagster.yaml").write_text(instance_config(template, ClusterSettings(postgres_url_env=URL_ENV)))
        with dg.DagsterInstance.from_config(str(home)) as instance:
            run = instance.create_run_for_job(dg.GraphDefinition("g").to_job())
            cut_events, cut_tags = [], []
            _disconnect_once_before(instance.event_log_storage._engine, "NOTIFY", url, cut_events)
            _disconnect_once_before(instance.run_storage._engine, "INSERT INTO RUN_TAGS", url, cut_tags)
            instance.report_engine_event("event 0", run)
            instance.add_run_tags(run.run_id, {"tag0": "0"})
            assert cut_events and cut_tags  # both cuts happened
            written, errors, stop = [0], [], threading.Event()

            def writer():
                while not stop.is_set():
                    n = len(written)
                    try:
                        instance.report_engine_event(f"event {n}", run)
                        if n % 10 == 0:
                            instance.add_run_tags(run.run_id, {f"tag{n}": str(n)})
                    except Exception as exc:  # noqa: BLE001  counted: the test fails with it
                        errors.append(repr(exc))
                        return
                    written.append(n)

            thread = threading.Thread(target=writer)
            thread.start()
            try:
                for _ in range(6):  # immediate restarts, as a crash and a supervisor's restart
                    time.sleep(0.5)
                    restart_postgres(tmp_path / "postgres")
                stop_postgres(tmp_path / "postgres")
                time.sleep(8)  # longer than dagster-postgres's own retries
                start_postgres(tmp_path / "postgres")
                time.sleep(1)
            finally:
                stop.set()
                thread.join(timeout=180)
            assert not errors, errors
            messages = [e.dagster_event.message for e in instance.all_logs(run.run_id)]
            assert messages == [f"event {n}" for n in written]  # each once, in order
            tagged = [f"tag{n}" for n in written if n % 10 == 0]
            assert {key: value for key, value in instance.get_run_by_id(run.run_id).tags.items()
                    if key.startswith("tag")} == {key: key[3:] for key in tagged}
            assert {key for key, _ in instance.get_run_tags(tag_keys=tagged)} == set(tagged)  # the rows too
    said = capfd.readouterr().err
    assert "the cluster's Postgres answers again" in said and url not in said and "127.0.0.1" not in said, said
