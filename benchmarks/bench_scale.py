"""A rehearsal at the seed's size on CPU, Dagster at 10,000 shard partitions, and the cluster's overhead.

Part `pipeline`: N prompts (60,000; generated locally) through the whole pipeline with the demo's
tiny real models, shard size 1,000 (60 train partitions plus val), 20,000 training steps, as
`gguf-trainer run` executes it. Printed per stage: wall time (Dagster's step events) and peak
RSS of the run's process tree (sampled every 0.25 s); per shard partition, the run's wall time
minus the shard's own compute (the teacher and student forward passes the shard records): what
orchestration, file writes and hashing cost on top; the `status` time; the UI's asset and
partition GraphQL queries, against the real webserver.

Part `partitions`: 10,000 shard partitions (10M prompts at 1,000 a shard, on paper) with
synthetic shard files and records: `status`, planning (what `run` decides with every shard
current) and the UI's partition queries.

Part `cluster` (needs PostgreSQL and redis-server, as .ci/run installs): the same shards
in-process, then through the Celery deployment with one and with two workers; per partition,
the orchestration cost on top of the shard compute.

Part `eta`: the demo's tiny real models precompute several shards (in-process, as a shard run does); the ETA
`status` shows after the first finished shard (lib/status/pace.py) against the measured end of the precompute.

    .venv/bin/python benchmarks/bench_scale.py                 # all parts at full size (an hour or more on CPU)
    .venv/bin/python benchmarks/bench_scale.py --part partitions
    .venv/bin/python benchmarks/bench_scale.py --quick         # small sizes (the tests run this)

Each part ends in a `rule:` line (`-> ok` or `-> FAIL`; exit 1 on a failure): status and planning
at 10,000 partitions stay under a second per 1,000 partitions, the cluster's per-partition
overhead stays under 10 s, and the ETA after the first shard is within ETA_TOLERANCE of the measured end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gguf_assets_tests"))  # servers.py: the cluster tests' real servers

CLI = [sys.executable, "-m", "gguf_assets.cli"]
ASSETS_QUERY = "{ assetNodes { assetKey { path } staleStatus staleCauses { reason } } }"
PARTITIONS_QUERY = ('{ assetNodeOrError(assetKey: {path: ["train_shards"]}) { ... on AssetNode { partitionKeys '
                    'partitionStats { numMaterialized numPartitions } assetPartitionStatuses { '
                    '... on DefaultPartitionStatuses { materializedPartitions } } } } }')
MAX_S_PER_1000_PARTITIONS = 1.0  # status and planning
MAX_CLUSTER_OVERHEAD_S = 10.0  # per partition, through Celery
ETA_TOLERANCE = 0.5  # the first shard's ETA against the measured rest: within 50 % (it pays for loading the models)


def env_without_project(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT",
                                                            "GGUF_ASSETS_FAULT")}
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_project(root: Path, materials: Path, *, train: int, val: int, shard_size: int, steps: int,
                mock_teacher: bool = False):
    from gguf_assets.lib.demo.demo import demo_settings
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import replace, write_project_file

    shutil.copytree(materials, root / "materials" / "demo")
    settings = replace(demo_settings(steps=steps, mock_teacher=mock_teacher),
                       corpus={"train_prompts": train, "val_prompts": val, "allow_fewer": False},
                       precompute={"shard_size": shard_size, "val_shard_size": min(val, shard_size)})
    write_project_file(root, settings)
    return ProjectPaths.of(root)


def instance_of(paths):
    import dagster as dg

    from gguf_assets.orchestration.instance import prepare_instance

    prepare_instance(paths)
    return dg.DagsterInstance.get()


class RssSampler:
    """Peak RSS of a process and its children, sampled every 0.25 s, with wall-clock timestamps."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                root = psutil.Process(self.pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                continue
            self.samples.append((time.time(), rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peak(self, start: float, end: float) -> int:
        return max((rss for t, rss in self.samples if start <= t <= end + 0.25), default=0)


def run_pipeline_sampled(paths, env: dict[str, str]) -> tuple[float, RssSampler]:
    began = time.monotonic()
    proc = subprocess.Popen([*CLI, "run", str(paths.root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    sampler = RssSampler(proc.pid)
    out, _ = proc.communicate()
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"gguf-trainer run failed:\n{out[-3000:]}")
    return time.monotonic() - began, sampler


def step_windows(instance) -> dict[str, list[tuple[float, float]]]:
    """Each stage's (start, end) wall-clock windows, from the step events of every run."""
    import dagster as dg

    windows: dict[str, list[tuple[float, float]]] = {}
    for run in instance.get_runs():
        starts = {}
        for record in instance.get_records_for_run(run.run_id, of_type={dg.DagsterEventType.STEP_START,
                                                                         dg.DagsterEventType.STEP_SUCCESS}).records:
            entry = record.event_log_entry
            if entry.dagster_event.event_type == dg.DagsterEventType.STEP_START:
                starts[entry.step_key] = entry.timestamp
            elif entry.step_key in starts:
                windows.setdefault(entry.step_key, []).append((starts[entry.step_key], entry.timestamp))
    return windows


def shard_overheads(instance) -> tuple[int, float, float]:
    """Over every shard run: (partitions, orchestration seconds per partition, shard compute seconds in all).

    A run's span is from its creation (its launch) to its end, so a cluster's queueing counts too."""
    import dagster as dg

    from gguf_assets.pipeline.names import SHARDS_JOB

    partitions, span, compute = 0, 0.0, 0.0
    for record in instance.get_run_records(filters=dg.RunsFilter(job_name=None)):
        if record.dagster_run.job_name not in SHARDS_JOB.values() or record.dagster_run.status.value != "SUCCESS":
            continue
        span += record.end_time - record.create_timestamp.timestamp()
        for event in instance.get_records_for_run(record.dagster_run.run_id,
                                                  of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records:
            metadata = event.event_log_entry.asset_materialization.metadata
            if "seconds" in metadata:
                partitions += 1
                compute += float(metadata["seconds"].value)
    return partitions, (span - compute) / max(1, partitions), compute


@contextlib.contextmanager
def webserver(paths):
    from gguf_assets.orchestration.instance import instance_env

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-m", "gguf_assets.definitions", "-h",
                             "127.0.0.1", "-p", str(port)], env={**env_without_project(), **instance_env(paths)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{base}/server_info", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("dagster-webserver did not start") from None
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def graphql_seconds(base: str, query: str, repeats: int = 3) -> tuple[float, dict]:
    """The median time of ``query`` (after one warm-up), and its answer."""
    def once() -> tuple[float, dict]:
        request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query}).encode(),
                                         headers={"Content-Type": "application/json"})
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as answer:
            data = json.load(answer)
        if "errors" in data:
            raise RuntimeError(f"GraphQL error: {data['errors']}")
        return time.perf_counter() - began, data["data"]

    once()
    times, data = zip(*(once() for _ in range(repeats)))
    return statistics.median(times), data[-1]


def ui_query_seconds(paths, repeats: int = 3) -> tuple[float, float, dict]:
    """The UI's asset query and train_shards partition query on the real webserver: (assets s, partitions s,
    the partition stats it answered)."""
    with webserver(paths) as base:
        assets_s, _ = graphql_seconds(base, ASSETS_QUERY, repeats)
        parts_s, answer = graphql_seconds(base, PARTITIONS_QUERY, repeats)
    return assets_s, parts_s, answer["assetNodeOrError"]["partitionStats"]


def status_seconds(paths, repeats: int = 3) -> tuple[float, float]:
    """`gguf-trainer status` as the user runs it (a process: wall, start-up included) and in-process."""
    from gguf_assets.cli import commands as cli

    walls = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run([*CLI, "status", str(paths.root)], env=env_without_project(), capture_output=True, check=True)
        walls.append(time.perf_counter() - began)
    with contextlib.redirect_stdout(io.StringIO()):
        cli.cmd_status(argparse.Namespace(project=str(paths.root)))  # imports and caches warm
    began = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        cli.cmd_status(argparse.Namespace(project=str(paths.root)))
    return min(walls), time.perf_counter() - began


def part_pipeline(tmp: Path, *, prompts: int, val: int, shard_size: int, steps: int, mock_teacher: bool = False,
                  repeats: int = 3) -> bool:
    from gguf_assets.lib.demo.demo import build_demo_materials
    from gguf_assets.lib.status.stages import STAGES

    models = "the demo's tiny student and a mock teacher" if mock_teacher else "the demo's tiny real models"
    print(f"\n## pipeline: {prompts} prompts ({prompts - val} train, {val} val), shard size {shard_size}, "
          f"{steps} steps, {models}")
    materials = tmp / "materials"
    build_demo_materials(materials, seed=0, n_prompts=prompts * 21 // 20 + 100)
    paths = new_project(tmp / "pipeline", materials, train=prompts - val, val=val, shard_size=shard_size,
                        steps=steps, mock_teacher=mock_teacher)
    wall, sampler = run_pipeline_sampled(paths, env_without_project())
    instance = instance_of(paths)
    windows = step_windows(instance)
    print(f"{'stage':<14}{'wall s':>10}{'peak RSS MiB':>15}")
    for stage in STAGES:
        spans = windows.get(stage, [])
        seconds = sum(end - start for start, end in spans)
        peak = max((sampler.peak(start, end) for start, end in spans), default=0)
        print(f"{stage:<14}{seconds:>10.1f}{peak / 2**20:>15.0f}")
    partitions, overhead, compute = shard_overheads(instance)
    print(f"whole `run`: {wall:.1f} s; shard partitions: {partitions}, shard compute {compute:.1f} s; per partition "
          f"on top of its compute: {overhead:.3f} s")
    status_wall, status_inproc = status_seconds(paths, repeats)
    print(f"status: {status_wall:.2f} s as a command ({status_inproc:.3f} s of it the status itself)")
    assets_s, parts_s, stats = ui_query_seconds(paths, repeats)
    print(f"GraphQL: assets {assets_s:.3f} s, train_shards partitions {parts_s:.3f} s "
          f"({stats['numMaterialized']}/{stats['numPartitions']} materialized)")
    expected = -(-(prompts - val) // shard_size)
    ok = stats["numMaterialized"] == stats["numPartitions"] == expected
    print(f"rule: the UI lists all {expected} train partitions materialized -> {'ok' if ok else 'FAIL'}")
    return ok


def part_eta(tmp: Path, *, shards: int, shard_size: int) -> bool:
    from gguf_assets.lib.core import atomic
    from gguf_assets.lib.corpus.corpus import build_corpus
    from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
    from gguf_assets.lib.demo.demo import build_demo_materials
    from gguf_assets.lib.materials.pinning.resolve import resolve_materials
    from gguf_assets.lib.precompute.shards import precompute_split
    from gguf_assets.lib.precompute.shards_run import plan_shards
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status.pace import precompute_pace
    from gguf_assets.lib.telemetry.progress import format_seconds

    val = shard_size
    print(f"\n## eta: {shards} train shards of {shard_size} prompts and 1 val shard, the demo's tiny real models")
    materials = tmp / "eta-materials"
    build_demo_materials(materials, seed=0, n_prompts=(shards + 1) * shard_size * 21 // 20 + 100)
    paths = new_project(tmp / "eta", materials, train=shards * shard_size, val=val, shard_size=shard_size, steps=10)
    settings = load_settings(paths.root)
    manifest = resolve_materials(paths, settings)
    build_corpus(paths, settings, manifest, fingerprint=corpus_fingerprint(paths, settings, manifest))
    shown: dict = {}
    start = time.perf_counter()

    def first_shard_done(_report) -> None:
        if not shown:
            shown["at"] = time.perf_counter() - start
            shown["pace"] = precompute_pace(paths, settings)

    for split in ("train", "val"):
        keys = [plan.key for plan in plan_shards(paths, settings, manifest, split)]
        precompute_split(paths, settings, manifest, split, keys, on_shard_done=first_shard_done)
    end = time.perf_counter() - start
    pace, at = shown["pace"], shown["at"]
    rest = end - at
    print(f"after the first shard ({at:.1f} s): {pace.text()}")
    print(f"predicted end: {at + pace.seconds_left:.1f} s; measured end: {end:.1f} s "
          f"(the rest took {format_seconds(rest)} against the ETA {format_seconds(pace.seconds_left)})")
    # Where the time went: each half's busy span (its sidecar) against the wall time between them.
    spans = [atomic.read_json(plan.folder(paths) / f"{half}.json") for split in ("train", "val")
             for plan in plan_shards(paths, settings, manifest, split) for half in ("teacher", "student")]
    per_shard = [round(t["finished_at"] - t["started_at"] + s["finished_at"] - s["started_at"], 1)
                 for t, s in zip(spans[::2], spans[1::2])]
    busy = sum(per_shard)
    print(f"per shard, both halves busy (s): {per_shard}; busy {busy:.1f} s of the {end:.1f} s wall")
    error = abs(pace.seconds_left - rest) / rest
    ok = error <= ETA_TOLERANCE
    print(f"rule: ETA after the first shard within {ETA_TOLERANCE:.0%} of the measured rest ({error:.0%}) "
          f"-> {'ok' if ok else 'FAIL'}")
    return ok


def part_partitions(tmp: Path, *, partitions: int, repeats: int = 3) -> bool:
    import dagster as dg
    from bench_status import build_project

    from gguf_assets.lib.demo.demo import build_demo_materials
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.pipeline.partitions import BY_SPLIT
    from gguf_assets.pipeline.plan import next_work

    print(f"\n## partitions: {partitions} train shard partitions, synthetic shard files and records")
    materials = tmp / "materials-p"
    build_demo_materials(materials, seed=0, n_prompts=partitions * 11 // 10 + 200)
    began = time.perf_counter()
    paths = build_project(tmp / "partitions", materials, partitions, shard_prompts=1, query_rows=4, target_dim=8)
    instance = instance_of(paths)
    for split in ("train", "val"):
        keys = sorted(p.name for p in (paths.root / "shards" / split).iterdir())
        instance.add_dynamic_partitions(BY_SPLIT[split].name, keys)
        for key in keys:  # what each shard's materialization records, in brief
            instance.report_runless_asset_event(dg.AssetMaterialization(f"{split}_shards", partition=key, metadata={
                "prompts": 1, "seconds": 0.01}))
    print(f"built in {time.perf_counter() - began:.0f} s")
    settings = load_settings(paths.root)
    status_wall, status_inproc = status_seconds(paths, repeats)
    began = time.perf_counter()
    work = next_work(paths, settings, instance)
    planning = time.perf_counter() - began
    if work is None or work.job != "train_export_evaluate":
        raise RuntimeError(f"with every shard current the next work is training, not {work}")
    assets_s, parts_s, stats = ui_query_seconds(paths, repeats)
    print(f"status: {status_wall:.2f} s as a command ({status_inproc:.3f} s in-process); planning (next_work with "
          f"every shard current): {planning:.3f} s")
    print(f"GraphQL: train_shards partitions {parts_s:.3f} s ({stats['numMaterialized']}/{stats['numPartitions']}), "
          f"assets {assets_s:.3f} s")
    bound = MAX_S_PER_1000_PARTITIONS * max(1.0, partitions / 1000)
    ok = status_inproc <= bound and planning <= bound and stats["numPartitions"] == partitions
    print(f"rule: status {status_inproc:.2f} s and planning {planning:.2f} s <= {bound:.1f} s at {partitions} "
          f"partitions -> {'ok' if ok else 'FAIL'}")
    return ok


def part_cluster(tmp: Path, *, shards: int, shard_size: int, worker_counts: tuple[int, ...] = (1, 2)) -> bool:
    from servers import postgres_server, redis_server

    from gguf_assets.lib.demo.demo import build_demo_materials

    print(f"\n## cluster: {shards} train shards of {shard_size} prompts (mock teacher), in-process and on Celery "
          "workers")
    materials = tmp / "materials-c"
    build_demo_materials(materials, seed=0, n_prompts=(shards + 1) * shard_size * 11 // 10 + 100)
    rows, ok = [], True
    modes = [("in-process", 0)] + [(f"celery, {n} worker{'s' if n > 1 else ''}", n) for n in worker_counts]
    for mode, workers in modes:
        paths = new_project(tmp / f"cluster-{workers}", materials, train=shards * shard_size, val=shard_size,
                            shard_size=shard_size, steps=5, mock_teacher=True)
        with contextlib.ExitStack() as stack:
            env = env_without_project()
            if workers:
                pg = stack.enter_context(postgres_server(tmp / f"pg-{workers}", free_port()))
                redis = stack.enter_context(redis_server(tmp / f"redis-{workers}", free_port())).url
                env.update(GGUF_ASSETS_POSTGRES_URL=pg, GGUF_ASSETS_REDIS_URL=redis)
                subprocess.run([*CLI, "cluster", str(paths.root), "--celery-broker-env", "GGUF_ASSETS_REDIS_URL"],
                               env=env, check=True, capture_output=True)
                for index in range(workers):
                    host = tmp / f"host-{workers}-{index}"
                    host.mkdir()
                    proc = subprocess.Popen([*CLI, "worker", str(paths.root), "--name", f"w{index}@%h"], cwd=host,
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
                    stack.callback(_stop_worker, proc)
                os.environ.update(GGUF_ASSETS_POSTGRES_URL=pg, GGUF_ASSETS_REDIS_URL=redis)
            wall, _ = run_pipeline_sampled(paths, env)
            instance = instance_of(paths)
            partitions, overhead, compute = shard_overheads(instance)
            instance.dispose()
        rows.append((mode, partitions, compute, overhead, wall))
    base = rows[0][3]
    print(f"{'mode':<20}{'partitions':>11}{'compute s':>10}{'overhead s/partition':>22}{'vs in-process':>15}"
          f"{'whole run s':>13}")
    for mode, partitions, compute, overhead, wall in rows:
        print(f"{mode:<20}{partitions:>11}{compute:>10.2f}{overhead:>22.3f}{overhead - base:>+15.3f}{wall:>13.1f}")
    worst = max(r[3] for r in rows)
    ok = worst <= MAX_CLUSTER_OVERHEAD_S
    print(f"rule: per-partition overhead {worst:.2f} s <= {MAX_CLUSTER_OVERHEAD_S:.0f} s -> {'ok' if ok else 'FAIL'}")
    return ok


def _stop_worker(proc: subprocess.Popen) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small: 60 prompts, mock teacher, 100 partitions, each timing once")
    parser.add_argument("--part", nargs="+", choices=("pipeline", "partitions", "cluster", "eta", "all"),
                        default=["all"],
                        help="which parts (several may be named)")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else 3  # timings of `status` and of the GraphQL queries: the best of, the median of
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        tmp = Path(tmp)
        os.chmod(tmp, 0o755)  # the Postgres server's own user must reach its folder
        if {"pipeline", "all"} & set(args.part):
            # Quick: 2 train shards and 1 val shard, each of 20 prompts (what the test checks the stages on).
            ok &= part_pipeline(tmp, prompts=60 if args.quick else 60_000, val=20 if args.quick else 500,
                                shard_size=20 if args.quick else 1000, steps=8 if args.quick else 20_000,
                                mock_teacher=args.quick, repeats=repeats)
        if {"partitions", "all"} & set(args.part):
            ok &= part_partitions(tmp, partitions=100 if args.quick else 10_000, repeats=repeats)
        if {"eta", "all"} & set(args.part):
            ok &= part_eta(tmp, shards=4 if args.quick else 8, shard_size=100 if args.quick else 400)
        if {"cluster", "all"} & set(args.part):
            # Quick: two workers only (the path one worker takes is the same, and each mode is a whole pipeline).
            ok &= part_cluster(tmp, shards=2 if args.quick else 20, shard_size=20 if args.quick else 100,
                               worker_counts=(2,) if args.quick else (1, 2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
