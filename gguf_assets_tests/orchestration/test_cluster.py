"""The same DAG with its Dagster records in a real PostgreSQL server (dagster-postgres), on loopback.

`gguf-trainer cluster DIR` points the project's instance at Postgres through an environment variable;
`run` then records every run there (nothing in SQLite), its results are byte-identical to a
single-machine run, the UI's GraphQL lists the runs from Postgres, and the project folder holds no
URL, host name or absolute path.
"""

import json
import socket
import subprocess
import urllib.request

import pytest
from conftest import CLI, FAULT_SETTINGS, cli_env, free_port, pipeline_outputs, wait_http
from servers import postgres_server

pytestmark = pytest.mark.slow  # a database server and a whole pipeline

URL_ENV = "GGUF_ASSETS_POSTGRES_URL"


@pytest.fixture
def postgres(tmp_path):
    with postgres_server(tmp_path / "postgres", free_port()) as url:
        yield url


def _runs_in_postgres(url: str) -> list[tuple[str, str]]:
    import psycopg2

    with psycopg2.connect(url) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT pipeline_name, status FROM runs ORDER BY create_timestamp")
        return cursor.fetchall()


def test_a_pipeline_recorded_in_postgres_matches_the_single_machine_run(make_project, reference_run, postgres):
    paths = make_project(**FAULT_SETTINGS)
    done = subprocess.run([*CLI, "cluster", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                          timeout=60)
    assert done.returncode == 0 and f"export {URL_ENV}=" in done.stdout, done.stdout + done.stderr
    # Without the URL in the environment: one clear line, nothing started.
    refused = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                             timeout=120)
    assert refused.returncode == 2 and f"${URL_ENV}, which is not set" in refused.stderr, refused.stderr
    assert not paths.materials_manifest.exists()

    env = cli_env(**{URL_ENV: postgres})
    done = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == reference_run[0]  # byte-identical to the embedded instance's run
    runs = _runs_in_postgres(postgres)
    assert {job for job, _ in runs} == {"materials_and_corpus", "precompute_train_shards", "precompute_val_shards",
                                        "train_export_evaluate"}, runs
    assert {status for _, status in runs} == {"SUCCESS"}
    assert not (paths.dagster_home / "history" / "runs.db").exists()  # nothing went to SQLite

    # A second run finds everything current, from the records in Postgres: no new run.
    again = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and len(_runs_in_postgres(postgres)) == len(runs), again.stdout + again.stderr

    # The UI reads the same records: its GraphQL lists the runs.
    port = free_port()
    exports = subprocess.run([*CLI, "env", str(paths.root)], capture_output=True, text=True, env=env, timeout=60,
                             check=True).stdout
    ui_env = {**env, **dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())}
    ui = subprocess.Popen([CLI[0], "-m", "dagster_webserver", "-m", "gguf_assets.definitions", "-h", "127.0.0.1",
                           "-p", str(port)], env=ui_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/server_info", timeout=120, proc=ui)
        query = json.dumps({"query": "{ runsOrError { ... on Runs { results { runId jobName status } } } }"})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=query.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            listed = json.load(answer)["data"]["runsOrError"]["results"]
    finally:
        ui.terminate()
        ui.wait(timeout=30)
    assert sorted(r["jobName"] for r in listed) == sorted(job for job, _ in runs)

    # The project folder names the variable, never the URL, the host or its own path.
    for file in (paths.root / "cluster.yaml", paths.dagster_home / "dagster.yaml", paths.materials_manifest,
                 paths.corpus_manifest, paths.adapter_manifest):
        text = file.read_text()
        assert postgres not in text and "127.0.0.1" not in text and str(paths.root) not in text, file
        assert socket.gethostname() not in text or socket.gethostname() in ("localhost",), file


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
