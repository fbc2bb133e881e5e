"""pipeline/private_api.py: what it changes in Dagster's behaviour (test_definitions checks its imports)."""

import os
import threading

import dagster as dg
import sqlalchemy
from sqlalchemy.pool import NullPool, StaticPool

from gguf_assets.orchestration.instance import prepare_instance
from gguf_assets.pipeline import private_api


def _counting(monkeypatch) -> list[str]:
    """Count the engines SQLAlchemy makes for Dagster's SQLite storage from here on (a fresh cache around them)."""
    made: list[str] = []

    def create_engine(url, **options):
        made.append(str(url))
        return sqlalchemy.create_engine(url, **options)

    monkeypatch.setattr(private_api, "_ENGINE_CACHE", private_api._EngineCache(create_engine))
    for module in private_api.SQLITE_STORAGE_MODULES:
        monkeypatch.setattr(module, "create_engine", module.create_engine)  # restored after the test
    private_api.reuse_sqlite_engines()
    return made


def test_dagster_s_sqlite_storage_makes_one_engine_per_database_file_not_one_per_event(make_project, monkeypatch):
    """A run writes dozens of events and reads its runs many times: Dagster's SQLite storage opens a connection for
    each, and without reuse_sqlite_engines each came with a new engine. With it, one engine per database file."""
    paths = make_project()
    prepare_instance(paths)  # the instance's files exist before counting
    made = _counting(monkeypatch)

    @dg.asset
    def noisy(context) -> int:
        for i in range(30):
            context.log.info(f"line {i}")  # one event each
        return 1

    with dg.DagsterInstance.get() as instance:
        for _ in range(2):
            assert dg.materialize([noisy], instance=instance).success
        runs = instance.get_runs()
        assert len(runs) == 2 and all(len(instance.all_logs(r.run_id)) > 30 for r in runs)
        threads = [threading.Thread(target=instance.get_runs) for _ in range(4)]  # one engine serves every thread
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # the runs index, the event index, each run's own events file, the schedules: each URL once
    assert len(made) == len(set(made)) <= 6, made
    assert any(url.endswith(f"{runs[0].run_id}.db") for url in made), made


def test_the_engine_cache_keys_by_url_and_options_bounds_itself_and_leaves_other_pools_alone(tmp_path, monkeypatch):
    made = _counting(monkeypatch)
    cache = private_api._ENGINE_CACHE
    first = cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=NullPool)
    assert cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=NullPool) is first
    assert cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=NullPool, connect_args={"timeout": 5}) is not first
    assert cache(f"sqlite:///{tmp_path / 'b.db'}", poolclass=NullPool) is not first
    pooled = cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=StaticPool)  # holds its connection: never shared
    assert cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=StaticPool) is not pooled
    for i in range(private_api.ENGINES_KEPT + 5):
        cache(f"sqlite:///{tmp_path / f'{i}.db'}", poolclass=NullPool)
    assert len(cache._engines) == private_api.ENGINES_KEPT
    before = len(made)
    assert cache(f"sqlite:///{tmp_path / 'a.db'}", poolclass=NullPool) is not first  # dropped, made again
    assert len(made) == before + 1
    with first.connect() as conn:  # a dropped engine still works for whoever holds it
        assert conn.execute(sqlalchemy.text("select 1")).scalar() == 1

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child starts with no engines of its parent's
        os.write(write, b"%d" % len(cache._engines))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"0" and len(cache._engines) > 0
