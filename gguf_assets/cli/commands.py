"""gguf-trainer's commands: create a project, run the demo, run the pipeline, open the UI, auto-resume, and the
rest (`gguf-trainer -h`). Started through gguf_assets/cli/__init__.py's main, which quiets a Ctrl-C while these
modules load and starts `run`'s pipeline process before loading them."""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

from gguf_assets.cli.processes import DAGSTER_NOISE, RUN_CHILD_ENV, WithoutLines, run_in_own_process_group
from gguf_assets.cli.prologue import quiet_exit_while_loading
from gguf_assets.cli.runs import add_parser as add_runs_parser
from gguf_assets.cli.services import (
    SERVICES_LOCK,
    SERVICES_LOG,
    CodeServer,
    ServiceOutput,
    StopSignals,
    check_ports_free,
    daemon_command,
    start_services,
    stop_all,
    studio_command,
    supervise,
    tensorboard_command,
    webserver_command,
)
from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.console import fill
from gguf_assets.lib.core.errors import ProjectNotWritable, UserError, os_refusal_message, write_refusal
from gguf_assets.lib.core.lock import hold_services, holder
from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.demo import DEMO_STEPS
from gguf_assets.lib.materials.hub import token_from_env
from gguf_assets.lib.materials.hub_shapes import quick_options
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.output import snapshots
from gguf_assets.lib.output.report import retrieval_text
from gguf_assets.lib.planning.estimate import (
    estimate,
    estimate_lines,
    kept_steps_text,
    missing_piece,
    named_gpus,
    parse_gpu_sizes,
    peak_gib,
    size_text,
    teacher_check,
)
from gguf_assets.lib.planning.time_estimate import time_lines
from gguf_assets.lib.precompute.shards_run import require_current
from gguf_assets.lib.project.layout import ProjectPaths, check_output_folders
from gguf_assets.lib.project.settings import (
    SECTION_HINTS,
    Settings,
    SettingsError,
    load_settings,
    write_project_file,
)
from gguf_assets.lib.status.pace import pace_lines
from gguf_assets.lib.status.states import State, status_view, where_stopped, with_running
from gguf_assets.lib.telemetry.curves_log import TENSORBOARD_DIR, TENSORBOARD_URL_ENV, tensorboard_timeseries_url
from gguf_assets.lib.telemetry.hardware import AUTO_WORKERS as AUTO
from gguf_assets.lib.training.better import better_offers
from gguf_assets.lib.training.training_run import planned_adapter_run
from gguf_assets.orchestration.cluster import (
    QUEUES,
    ClusterError,
    ClusterSettings,
    cluster_file,
    load_cluster,
    write_cluster,
)
from gguf_assets.orchestration.diagnosis import dagster_storage_problem
from gguf_assets.orchestration.outages import PipelineFailed
from gguf_assets.pipeline.groups import lineage_path

# The modules above load neither torch nor dagster. What loads them (seconds each) is imported in the command that
# needs it, so that `status`, `init` and --help load neither (test_console.py checks `status`).

INIT_HEADER = """gguf_assets project settings. Every key is documented in docs/settings.md.
Materials are hub repo ids (owner/name, optionally @revision) or local folders (relative to this folder).
The HF token is read from the HF_TOKEN environment variable and never stored here."""


def cmd_init(args: argparse.Namespace) -> int:
    paths = ProjectPaths.of(args.project)
    if paths.project_file.exists() and not args.force:
        print(f"{paths.project_file} already exists; edit it, or pass --force to overwrite it with defaults.",
              file=sys.stderr)
        return 1
    paths.root.mkdir(parents=True, exist_ok=True)
    write_project_file(paths.root, Settings(), header=INIT_HEADER, hints=SECTION_HINTS)
    from gguf_assets.orchestration.instance import prepare_instance

    prepare_instance(paths)
    print(f"created {paths.project_file}\nset materials.teacher, materials.student and materials.datasets, then run:\n"
          f"  {trainer('run', paths.root)}")
    return 0


def _print_status(paths: ProjectPaths, *, ask_hub: bool = False) -> None:
    """Every stage's state, and "will it fit?" while shards are missing. ``ask_hub``: read a hub id's config from
    the hub when the project's .cache lacks it (`status` itself; after a run, the run's own outcome comes first)."""
    settings = load_settings(paths.root)
    view = status_view(paths, settings)  # the pace lines reuse its shard plans: the corpus is read once
    stages = with_running(view.stages, holder(paths.lock_file))
    for s in stages:
        print(s.console_text())
    for line in pace_lines(paths, settings, stages, view):  # measured speed and ETA, from the first shard/log step on
        print(fill(f"  {line}"))
    if any(s.stage.endswith("_shards") and s.state != State.CURRENT for s in stages):  # "will it fit?", before loading
        print(fill(_memory_line(paths, settings, ask_hub=ask_hub)))


def _memory_line(paths: ProjectPaths, settings, *, ask_hub: bool) -> str:
    """The memory estimate in one status line (`gguf-trainer estimate DIR` has the details); a hub that does not
    answer within a few seconds makes it one line saying so, never a slow or failed status."""
    try:  # the HF token the materials step sends; never printed
        lines = estimate(paths, settings, token=token_from_env(), options=quick_options(), ask_hub=ask_hub)
    except (UserError, OSError, ValueError, KeyError) as exc:
        return f"  memory: not known yet ({str(exc).splitlines()[0]})"
    if missing_piece(lines):
        return f"  memory: not known yet: {missing_piece(lines)}"
    parts = ", ".join(f"{line.part} {size_text(line.gib)}" for line in lines)
    return (f"  memory: peak on one GPU {size_text(peak_gib(lines))} ({parts}); details: "
            f"`{trainer('estimate', paths.root)}`")


STOPPED_EXIT = 130  # the shell's code for a Ctrl-C
VERIFY_PROGRESS_S = 2.0  # how often `verify` prints how far it is



def _workers(value: str) -> int | str:
    """`--workers`: a count of at least 1, or auto."""
    if value == AUTO or (value.isdigit() and int(value) >= 1):
        return value if value == AUTO else int(value)
    raise argparse.ArgumentTypeError(f"{value!r}: give a number of workers (1 or more) or {AUTO}")


def _run(paths: ProjectPaths, *, workers: int | str | None = None, cancel_on_stop: bool = False,
         stop: StopSignals | None = None) -> int:
    """Run the pipeline, print the status, then the outcome: the results, or why (and where) it stopped. ``stop``:
    the caller's, which notes the stops forwarded to the pipeline (run_in_own_process_group)."""
    if os.environ.get(RUN_CHILD_ENV) != "1":
        return run_in_own_process_group(["run", str(paths.root), *(["--workers", str(workers)] if workers else []),
                                         *(["--cancel-on-stop"] if cancel_on_stop else [])], stop=stop)
    faults.point("pipeline-load")  # before any stop handler of this process: a stop here kills it
    from gguf_assets.orchestration.launching import run_pipeline

    sys.stderr = WithoutLines(sys.stderr, DAGSTER_NOISE)

    outcome, code = None, 0
    try:
        run_pipeline(paths, workers=workers, cancel_on_stop=cancel_on_stop)
    except PipelineFailed as exc:
        outcome, code = f"pipeline failed at {exc}", 1
    except KeyboardInterrupt:
        outcome, code = (f"stopped {_where_stopped(paths)}. Everything finished so far is kept; "
                         f"`{trainer('run', paths.root)}` continues from there.", STOPPED_EXIT)
    _print_status(paths)
    if outcome:
        print(outcome, file=sys.stderr)
    else:
        _print_results(paths)
    return code


def _where_stopped(paths: ProjectPaths) -> str:
    try:
        return where_stopped(paths, load_settings(paths.root))
    except SettingsError:
        return "(project.yaml is not valid now)"


def _print_results(paths: ProjectPaths) -> None:
    settings = load_settings(paths.root)
    report_file = paths.report_json(settings)
    if report_file.is_file():
        report = atomic.read_json(report_file)
        print(f"GGUF:    {paths.located(report['gguf_path'])}")
        print(f"report:  {report_file}")
        cosine = (report[VAL_CENTRED_COSINE] if report[VAL_CENTRED_COSINE] is not None
                  else report["val_centred_cosine_torch"])
        print(f"val centred cosine: {cosine:.4f}  ({report['verdict']})")
        # Earlier weights that scored higher, each with the command that gives them (on a line of its own, whole).
        for text, command in better_offers(report.get("better_weights") or [], trainer, paths.root):
            print(textwrap.fill(text, 80, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
            print(f"    {command}")
        if (retrieval := retrieval_text(report)) is not None:
            print(f"prompt retrieval: {retrieval}")
        print(f"open the UI (runs, metrics, report): {trainer('ui', paths.root)}")


def cmd_run(args: argparse.Namespace) -> int:
    paths = ProjectPaths.of(args.project)
    # A read-only project (a copy on read-only media, another user's folder) is refused before anything loads or
    # starts, with the one line that says so; `status`, `runs` and `verify` read it as usual.
    refused = write_refusal(paths.root, [paths.dagster_home, paths.root], command="run")
    if refused:
        raise ProjectNotWritable(refused)
    check_output_folders(paths, load_settings(paths.root))  # fail fast on a bad project.yaml or output folder
    return _run(paths, workers=getattr(args, "workers", None), cancel_on_stop=getattr(args, "cancel_on_stop", False),
                stop=getattr(args, "stop", None))


def cmd_env(args: argparse.Namespace) -> int:
    """Print the exports that the Dagster CLI, `dagster dev` and `dagster-daemon run` need for a project."""
    from gguf_assets.orchestration.instance import instance_env, prepare_instance

    paths = ProjectPaths.of(args.project)
    load_settings(paths.root)
    prepare_instance(paths)
    for name, value in instance_env(paths).items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    paths = ProjectPaths.of(args.project)
    _print_status(paths, ask_hub=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gguf_assets.lib.demo.demo import build_demo_materials, demo_settings

    start = time.perf_counter()
    paths = ProjectPaths.of(args.project)
    if not paths.project_file.exists():
        demo_root = paths.root / "materials" / "demo"
        print(f"building the tiny demo models and prompts in {demo_root} …")
        build_demo_materials(demo_root, seed=args.seed)
        write_project_file(paths.root, demo_settings(steps=args.steps or DEMO_STEPS),
                           header="gguf_assets demo project: tiny random-weight Qwen3-MoE teacher, Qwen3 student.\n"
                                  + INIT_HEADER)
    else:
        print(f"{paths.project_file} exists; continuing that project")
    code = _run(paths)
    if code == 0:
        print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    return code


def cmd_ui(args: argparse.Namespace) -> int:
    from gguf_assets.orchestration.instance import prepare_instance, size_gpu_pool

    paths = ProjectPaths.of(args.project)
    load_settings(paths.root)
    base = f"http://{args.host}:{args.port}"
    studio = f"http://{args.host}:{args.studio_port}"
    url = "" if args.no_tensorboard else f"http://{args.host}:{args.tensorboard_port}"
    # A Ctrl-C is noted, not raised, from here on: Dagster loads below (seconds), and an exception raised by the
    # signal in one of importlib's weakref callbacks would be dropped, so `ui` would go on to start every server.
    # From the first start on, a noted Ctrl-C stops what was started.
    with StopSignals() as stop:
        # Before any port is probed: a studio already open for this project is named, not refused port by port.
        services_lock = hold_services(paths.dagster_home / SERVICES_LOCK, {
            "studio": studio, "Dagster UI": base, **({"TensorBoard": url} if url else {})})
        keep = (services_lock,)
        prepare_instance(paths)
        import dagster as dg

        size_gpu_pool(dg.DagsterInstance.get())  # the run queue holds UI-launched GPU runs to one per GPU
        check_ports_free(args.host, {"--port": args.port, "--studio-port": args.studio_port,
                                     **({} if args.no_tensorboard else {"--tensorboard-port": args.tensorboard_port})})
        if url:
            os.environ[TENSORBOARD_URL_ENV] = url  # the adapter's page links to it (runs inherit it)
            (paths.root / TENSORBOARD_DIR).mkdir(exist_ok=True)
        if stop.signal is not None:  # stopped while Dagster loaded: nothing was started
            return _stopped_before_start(stop.signal)
        services: list[subprocess.Popen] = []
        # Their output reaches this console through .dagster/services.log, and only until they are told to stop.
        output = ServiceOutput(paths.dagster_home / SERVICES_LOG)
        code_server = CodeServer()
        try:
            # The studio first: the one page for this project (verdict, stages and why, Run and Stop).
            print(f"Studio for {paths.root} on {studio}", flush=True)
            services += start_services([studio_command(paths, args.host, args.studio_port, dagster_url=base,
                                                       tensorboard_url=url, allow_hosts=args.allow_host,
                                                       spare_run=not args.no_spare_run)],
                                       log_file=output.file, keep_fds=keep)
            if url and stop.signal is None:
                log_file = paths.dagster_home / "tensorboard.log"
                services += start_services([tensorboard_command(paths, args.host, args.tensorboard_port,
                                                                    args.allow_host)],
                                           log_file=log_file, keep_fds=keep)
                print(fill(f"TensorBoard (training curves, unsmoothed, the loss first) on "
                           f"{tensorboard_timeseries_url(url)} (its log: {log_file})"), flush=True)
            if stop.signal is None:
                print(fill(f"Dagster UI for {paths.root} on {base} (Ctrl-C to stop); the whole pipeline: "
                           f"{base}{lineage_path()}"), flush=True)
                services.append(code_server.start(log_file=output.file, keep_fds=keep))
            if stop.signal is None and code_server.wait_until_serving(services[-1], stop):
                workspace = code_server.workspace
                services += start_services([webserver_command(args.host, args.port, args.allow_host,
                                                              workspace=workspace),
                                            *([] if args.no_daemon else [daemon_command(workspace=workspace)])],
                                           log_file=output.file, keep_fds=keep)
        except BaseException:  # a service that cannot start: the others stop too
            stop_all(services, output)
            code_server.close()
            raise
        try:
            return supervise(services, stop=stop, output=output)
        finally:
            code_server.close()


def _stopped_before_start(signum: int) -> int:
    """Say that a stop came before the servers (or the pipeline) started; the shell's code for that signal."""
    print(f"stopped ({'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def cmd_auto_resume(project: str, *, daemon: bool, ui_port: int | None = None, ui_host: str = "127.0.0.1") -> int:
    """At boot: mark cut-off runs failed, continue the pipeline, then keep the daemon running.

    With ``ui_port`` the webserver starts first, so the resumed run can be watched. With
    ``output.auto_resume: false`` it only reports what is unfinished and exits: no run, no daemon,
    no UI (the project asked not to be resumed by itself).
    """
    from gguf_assets.orchestration.instance import prepare_instance, size_gpu_pool

    paths = ProjectPaths.of(project)
    settings = load_settings(paths.root)
    prepare_instance(paths)
    import dagster as dg

    from gguf_assets.pipeline.resume import mark_interrupted_runs

    instance = dg.DagsterInstance.get()
    if not settings.output.auto_resume:
        marked = mark_interrupted_runs(instance)
        print(f"project {paths.root}: marked {len(marked)} interrupted run(s) as failed {marked if marked else ''}")
        _print_status(paths)
        print(f"output.auto_resume is false in {paths.project_file}: only reporting what is unfinished; "
              f"`{trainer('run', paths.root)}` continues it")
        return 0
    size_gpu_pool(instance)
    # From here on a stop (Ctrl-C; SIGTERM from systemd, or to the whole process group) is noted, never acted on
    # where it lands: one that came while the pipeline's process loaded (it dies of the signal, before its own
    # handlers, without its "stopped" line or code) was once taken for a finished pipeline, and the daemon started
    # and ran on; one between two steps here would kill this process and leave the servers it started running.
    with StopSignals() as stop:
        services: list[subprocess.Popen] = []
        output = None
        keep: tuple[int, ...] = ()
        if daemon or ui_port is not None:  # its servers are the project's one set, as `ui`'s are
            keep = (hold_services(paths.dagster_home / SERVICES_LOCK, {
                "Dagster UI": f"http://{ui_host}:{ui_port}"} if ui_port is not None else {}),)
            output = ServiceOutput(paths.dagster_home / SERVICES_LOG)
        code = None
        code_server = CodeServer()

        def serving_code() -> bool:
            """The project's code server for the webserver and the daemon, started at the first one's need."""
            if not services:  # the code server is the first of them
                services.append(code_server.start(log_file=output.file, keep_fds=keep))
            return code_server.wait_until_serving(services[0], stop)

        try:
            if ui_port is not None and stop.signal is None:
                print(f"Dagster UI for {paths.root} on http://{ui_host}:{ui_port}", flush=True)
                if serving_code():
                    services += start_services([webserver_command(ui_host, ui_port,
                                                                  workspace=code_server.workspace)],
                                               log_file=output.file, keep_fds=keep)
            if stop.signal is None:
                marked = mark_interrupted_runs(instance)
                print(f"project {paths.root}: marked {len(marked)} interrupted run(s) as failed "
                      f"{marked if marked else ''}")
                _print_status(paths)
                code = cmd_run(argparse.Namespace(project=project, stop=stop))
            # A stop before or during the pipeline stops everything; the daemon is not started.
            if code == STOPPED_EXIT or stop.signal is not None:
                stop_all(services, output)
                return code if code == STOPPED_EXIT else _stopped_before_start(stop.signal)
            if daemon:
                print("starting dagster-daemon for the project (sensors, schedules); Ctrl-C to stop", flush=True)
                if serving_code():
                    services += start_services([daemon_command(workspace=code_server.workspace)],
                                               log_file=output.file, keep_fds=keep)
            if services:
                return supervise(services, stop=stop, output=output)
        except BaseException:
            stop_all(services, output)
            raise
        finally:
            code_server.close()
        if output is not None:
            output.close()
        return code


def cmd_estimate(args: argparse.Namespace) -> int:
    """How much memory the project's pair needs, from the safetensors headers, before anything loads."""
    paths = ProjectPaths.of(args.project)
    settings = load_settings(paths.root)
    sizes = parse_gpu_sizes(args.gpus) if args.gpus is not None else None
    print(fill(f"memory estimate for {paths.root} (weights and training state; activations come on top):"))
    lines = estimate(paths, settings, token=token_from_env())
    for line in estimate_lines(paths, settings, gpu_sizes_gib=sizes, token=token_from_env(), lines=lines):
        print(fill(line))
    print(fill(kept_steps_text(settings, lines)))
    gpus = named_gpus(sizes) if sizes else None  # --gpus: the time too is for them
    print("time estimate:\n" + "\n".join(fill(f"  {line}") for line in time_lines(paths, settings, gpus=gpus)))
    checked = teacher_check(paths, settings, token=token_from_env())
    if checked is None:
        return 0
    passed, line = checked
    print(fill(f"teacher: {line}"))
    return 0 if passed else 1


def cmd_cluster(args: argparse.Namespace) -> int:
    """Keep the project's Dagster records in Postgres (or, with --off, back in the embedded SQLite)."""
    paths = ProjectPaths.of(args.project)
    load_settings(paths.root)
    if args.off:
        cluster_file(paths.root).unlink(missing_ok=True)
        print(f"{paths.root}: back to the embedded instance (SQLite in {paths.dagster_home}). Runs recorded in "
              "Postgres stay there; the results are in the project's files either way.")
        return 0
    broker = getattr(args, "celery_broker_env", None)
    file = write_cluster(paths.root, ClusterSettings(postgres_url_env=args.postgres_url_env, celery_broker_env=broker))
    env = args.postgres_url_env
    lines = [
        f"wrote {file}: this project's runs, events and schedules go to the Postgres database at ${env}"
        + (f", and its runs to the Celery workers through the Redis broker at ${broker}." if broker else "."),
        "One database per project. On every machine that runs or watches it (the folder may be mounted anywhere):",
        f"  export {env}=postgresql://USER:PASSWORD@HOST:5432/DATABASE   # never written to the project",
    ]
    if broker:
        lines += [f"  export {broker}=redis://HOST:6379/0   # never written to the project",
                  f"  {trainer('worker', paths.root)}   # on each GPU machine, one per GPU (CUDA_VISIBLE_DEVICES=N)"]
    lines += [
        f"  {trainer('run', paths.root)}   # the pipeline, " + ("on the workers" if broker else "recorded in Postgres"),
        f"  {trainer('ui', paths.root)}    # studio, Dagster UI and daemon, reading the same records",
        f"  eval \"$({trainer('env', paths.root)})\" && dagster-daemon run   # the daemon alone",
        "A database for it, on Debian: apt install postgresql, then as postgres: createuser -P USER; "
        "createdb -O USER DATABASE" + ("; the broker: apt install redis-server" if broker else ""),
    ]
    print("\n".join(lines))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """A cluster worker: take this project's runs from the Celery queues and execute them here, one at a time."""
    from gguf_assets.orchestration.instance import prepare_instance

    paths = ProjectPaths.of(args.project)
    if not paths.project_file.is_file():  # each run reads the settings; a worker only needs the folder mounted
        raise ClusterError(f"{paths.project_file} does not exist: mount the project folder there, or pass its path.")
    cluster = load_cluster(paths.root)
    if cluster is None or not cluster.runs_on_workers:
        raise ClusterError(f"{paths.root} runs its work in the process that starts it; for workers, first "
                           f"`{trainer('cluster', paths.root)} --celery-broker-env GGUF_ASSETS_REDIS_URL`.")
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    unknown = sorted(set(queues) - set(QUEUES))
    if unknown or not queues:
        raise ClusterError(f"--queues {args.queues}: the queues are {', '.join(QUEUES)} (gpu: precompute and "
                           "training; cpu: materials and corpus).")
    prepare_instance(paths)
    import dagster as dg

    from gguf_assets.orchestration.cluster_workers import serve_runs

    name = args.name or f"gguf-{os.getpid()}@%h"
    print(f"worker {name} for {paths.root}: taking runs from {', '.join(queues)} (Ctrl-C finishes the current run, "
          "then stops)", flush=True)
    with dg.DagsterInstance.get() as instance:
        serve_runs(instance, queues=queues, name=name)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-read every file the project reuses or delivered against its recorded hash, whatever the stamps say."""
    from gguf_assets.lib.status import verify_project as v

    paths = ProjectPaths.of(args.project)
    settings = load_settings(paths.root)
    last = {"t": time.monotonic()}

    def progress(done: int, total: int, read: int) -> None:
        if time.monotonic() - last["t"] >= VERIFY_PROGRESS_S or done == total:
            last["t"] = time.monotonic()
            print(f"  {done}/{total} files, {read / 1e6:.1f} MB read", flush=True)

    print(f"verifying {paths.root} (every byte, against the recorded sha256) …", flush=True)
    leftovers = snapshots.remove_dead_snapshot_temps(paths.output_dir(settings), settings.output.adapter_name)
    if leftovers:
        print(f"  removed {leftovers} temp file(s) that killed snapshot writes left in the output folder")
    results, seconds = v.timed_verify(paths, settings, on_progress=progress)
    by_stage: dict[str, list] = {}
    for result in results:
        by_stage.setdefault(result.file.stage, []).append(result)
    for stage, stage_results in by_stage.items():
        bad = [r for r in stage_results if r.state != v.OK]
        state = v.OK if not bad else v.DAMAGED if any(r.state == v.DAMAGED for r in bad) else v.MISSING
        print(f"  {stage:<12} {state:<8} {len(stage_results) - len(bad)}/{len(stage_results)} files ok")
        for r in bad:
            print(f"      {r.state}: {paths.stored(r.file.path)}"
                  + (" (yours: a source file)" if r.file.owner == "yours" else ""))
    print(v.summary_line(results, seconds))
    bad = [r for r in results if r.state != v.OK]
    if not bad:
        return 0
    if args.repair:
        for line in v.repair(paths, bad):
            print(f"  repaired: {line}")
        print(f"`{trainer('run', paths.root)}` redoes exactly those.")
    else:
        print(f"`{trainer('verify', paths.root, '--repair')}` marks them, so the next run redoes "
              "exactly those.")
    return 1


def cmd_snapshot(args: argparse.Namespace) -> int:
    """A GGUF of the adapter as it is now (or at its best, or a kept step), while training runs or after."""
    paths = ProjectPaths.of(args.project)
    settings = load_settings(paths.root)
    materials = load_manifest(paths)
    run_dir = paths.checkpoints_dir(planned_adapter_run(paths, settings, materials).fingerprint)
    output_dir = paths.output_dir(settings)
    if args.list or args.delete is not None:
        if args.delete is not None:
            which = int(args.delete) if args.delete.isdigit() else args.delete  # a step, while it names one file
            for removed in snapshots.delete_snapshot(paths, run_dir, which, output_dir=output_dir):
                print(f"deleted {removed}")
        _print_snapshots(paths, run_dir, output_dir)
        return 0
    if not snapshots.has_started(paths, run_dir):
        raise snapshots.SnapshotError(f"no training run of these settings has started in {paths.root} yet: "
                                      f"`{trainer('run', paths.root)}` starts it")
    val_folders = require_current(paths, settings, materials, "val")
    entry = snapshots.take_snapshot(paths, settings, materials, run_dir, val_folders=val_folders, step=args.step,
                                    best=args.best, evaluate=args.eval, say=print)
    score = entry.get(VAL_CENTRED_COSINE)
    print(f"snapshot of step {entry['step']} of {entry['planned_steps']} ({entry['weights']}): "
          f"{paths.located(entry['file'])}")
    if entry.get("same_file_as"):
        print(f"  the same file as {entry['same_file_as']}, the run's GGUF (a hard link: no second copy)")
    print(f"  val centred cosine at that step: {'n/a' if score is None else f'{score:.4f}'}"
          + (f"; this GGUF on the val shards: {entry['eval']['val_centred_cosine']:.4f}" if "eval" in entry else ""))
    if (retrieval := retrieval_text(entry.get("eval") or {})) is not None:
        print(f"  its prompt retrieval: {retrieval}")
    return 0


def _print_snapshots(paths: ProjectPaths, run_dir, output_dir) -> None:
    """`snapshot --list`: the snapshot GGUFs and the steps a snapshot can take, of the run and the runs it
    continues (snapshots.lineage_snapshots: the studio's list and a refused --step say the same)."""
    lineage = snapshots.lineage_snapshots(paths, run_dir, output_dir)

    def say(line: str) -> None:  # 80 columns
        print(fill(line))

    say(f"training run {run_dir.name}" + "".join(f", which continues {run}" for run in lineage.runs[1:]))
    say(f"snapshot GGUFs in {output_dir}: {len(lineage.files) or 'none'}")
    for file in lineage.files:
        e = file.entry
        score, evaluated = e.get(VAL_CENTRED_COSINE), file.evaluation(paths).get(VAL_CENTRED_COSINE)
        same = file.same_file_as(paths)
        say(f"  {file.name}: step {e.get('step')} of {e.get('planned_steps')} ({e.get('weights')})"
            + (f" of run {file.run}" if file.run != run_dir.name else "")
            + f", val centred cosine {'n/a' if score is None else f'{score:.4f}'}"
            + (f", GGUF eval {evaluated:.4f}" if evaluated is not None else "")
            + (f", {e['bytes'] / 2**20:.1f} MiB" if isinstance(e.get("bytes"), int) else "")
            + (f", the same file as {os.path.basename(same)}" if same else "")
            + ("" if file.path.is_file() else " (missing)"))
    say(f"steps a snapshot can take: {lineage.steps_text()}")
    print(f"  take one:   {trainer('snapshot', paths.root, '--step', 'N')}")
    print(f"  delete one: {trainer('snapshot', paths.root, '--delete', 'FILE')}")


DESCRIPTION = """Train an adapter that lets a small student LLM stand in for an image model's large teacher
LLM, and export it as the GGUF files ggk loads. Everything of a project (settings, downloads, shards, checkpoints,
the GGUF and its report) lives in one folder: make one with `init` (or try `demo`), then `run` it; `status`,
`runs` and `ui` (the studio, with Run and Stop) show where it stands. `gguf-trainer COMMAND -h` tells more."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gguf-trainer", description=DESCRIPTION)
    parser.add_argument("--auto-resume", metavar="PROJECT",
                        help="at boot: mark cut-off runs failed, continue the pipeline, keep dagster-daemon running")
    parser.add_argument("--no-daemon", action="store_true",
                        help="with --auto-resume: exit instead of starting the daemon")
    parser.add_argument("--ui-port", type=int, metavar="PORT",
                        help="with --auto-resume: also serve the Dagster UI on this port, from the start")
    parser.add_argument("--ui-host", default="127.0.0.1", help="with --ui-port: the address to listen on")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # not the 100-column list of every name
    for add_verbs in (_pipeline_verbs, _output_verbs, _cluster_verbs, _upkeep_verbs, _service_verbs):
        add_verbs(sub)
    return parser


def _pipeline_verbs(sub) -> None:
    """init, demo, run, status and runs: a project and its pipeline."""
    p = sub.add_parser("init", help="create a project folder with a commented project.yaml")
    p.add_argument("project")
    p.add_argument("--force", action="store_true", help="overwrite an existing project.yaml")
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("demo", help="build the tiny demo project and run the whole pipeline on it")
    p.add_argument("project", nargs="?", default="demo-project")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default: the demo's {DEMO_STEPS})")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("run", help="materialize everything missing or stale, through Dagster")
    p.add_argument("project")
    p.add_argument("--workers", type=_workers, default=None,
                   help="shard runs in parallel: a number, or auto for one per visible GPU, each pinned to its own "
                        "(default: 1 process; on a cluster, as many runs as workers answer)")
    p.add_argument("--cancel-on-stop", action="store_true",
                   help="on a cluster: Ctrl-C also cancels the runs on the workers (default: they go on)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("status", help="show which stages are current, stale or missing")
    p.add_argument("project")
    p.set_defaults(func=cmd_status)
    add_runs_parser(sub)


def _output_verbs(sub) -> None:
    """snapshot and estimate: a GGUF now, and the memory a run will need."""
    p = sub.add_parser("snapshot", help="a GGUF of the adapter now (or --best, or a kept --step N), also while it "
                                        "trains")
    p.add_argument("project")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, metavar="N",
                       help="a kept step (training.keep_steps_*), a checkpoint or the final step (--list shows them)")
    which.add_argument("--best", action="store_true", help="the best validated weights so far")
    which.add_argument("--list", action="store_true",
                       help="list the snapshot GGUFs and the steps a snapshot can take (this run's and those of the "
                            "runs it continues)")
    which.add_argument("--delete", metavar="FILE",
                       help="delete one snapshot GGUF, named by its file (a step is enough when it has one file)")
    p.add_argument("--eval", action="store_true", help="also score the GGUF on the val shards (on the CPU)")
    p.set_defaults(func=cmd_snapshot)
    p = sub.add_parser("estimate", help="how much memory and time the precompute and training need, before a run")
    p.add_argument("project")
    p.add_argument("--gpus", metavar="GIB,GIB", default=None,
                   help="plan for these GPUs, GiB each (for example 24,24); default: this machine's")
    p.set_defaults(func=cmd_estimate)


def _cluster_verbs(sub) -> None:
    """cluster and worker: the project's records in Postgres, its runs on Celery workers."""
    p = sub.add_parser("cluster", help="keep the project's Dagster records in Postgres (docs/cluster.md)")
    p.add_argument("project")
    p.add_argument("--postgres-url-env", default="GGUF_ASSETS_POSTGRES_URL",
                   help="the environment variable that holds the Postgres URL (default GGUF_ASSETS_POSTGRES_URL)")
    p.add_argument("--celery-broker-env", default=None, metavar="NAME",
                   help="run the work on Celery workers (`gguf-trainer worker`), with the Redis broker at the URL in "
                        "this environment variable (for example GGUF_ASSETS_REDIS_URL)")
    p.add_argument("--off", action="store_true", help="back to the embedded single-machine instance (SQLite)")
    p.set_defaults(func=cmd_cluster)
    p = sub.add_parser("worker", help="on a cluster: take runs from the workers' queues and execute them")
    p.add_argument("project", help="the project folder, as this machine mounts it")
    p.add_argument("--queues", default="gpu,cpu",
                   help="the queues to take runs from (default gpu,cpu; a machine without a GPU: cpu)")
    p.add_argument("--name", default=None, help="the worker's Celery name (default gguf-<pid>@<host name>)")
    p.set_defaults(func=cmd_worker)


def _upkeep_verbs(sub) -> None:
    """verify and env: the project's files checked, and the Dagster CLI's environment."""
    p = sub.add_parser("verify", help="re-read every file the project reuses or delivered against its sha256")
    p.add_argument("project")
    p.add_argument("--repair", action="store_true",
                   help="mark the damaged files so that the next `run` redoes exactly those")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("env", help="print the environment the Dagster CLI needs for a project (eval it)")
    p.add_argument("project")
    p.set_defaults(func=cmd_env)


def _service_verbs(sub) -> None:
    """auto-resume and ui: the processes that stay up."""
    p = sub.add_parser("auto-resume", help="at boot: mark cut-off runs failed, continue the pipeline, keep "
                                           "dagster-daemon running (the same as --auto-resume PROJECT)")
    p.add_argument("project")
    p.add_argument("--no-daemon", action="store_true", help="exit instead of starting the daemon")
    p.add_argument("--ui-port", type=int, metavar="PORT", help="also serve the Dagster UI on this port, from the start")
    p.add_argument("--ui-host", default="127.0.0.1", help="with --ui-port: the address to listen on")
    p.set_defaults(func=lambda a: cmd_auto_resume(a.project, daemon=not a.no_daemon, ui_port=a.ui_port,
                                                  ui_host=a.ui_host))
    p = sub.add_parser("ui", help="open the studio (the project's page: result, Run and Stop, settings), the "
                                  "Dagster UI and TensorBoard")
    p.add_argument("project")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000, help="the Dagster UI's port")
    p.add_argument("--no-daemon", action="store_true", help="start no dagster-daemon (sensors, auto-resume)")
    p.add_argument("--studio-port", type=int, default=3001,
                   help="the studio page's port (this project: verdict, stages and why, Run and Stop)")
    p.add_argument("--tensorboard-port", type=int, default=6006, help="TensorBoard's port (training curves)")
    p.add_argument("--no-tensorboard", action="store_true", help="do not start TensorBoard")
    p.add_argument("--no-spare-run", action="store_true",
                   help="the studio keeps no run process loaded ahead of Run (saves its memory and the CPU of "
                        "loading it; Run's first step then comes a few seconds later)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="another host name the studio and the Dagster UI may be opened under (a LAN name, a "
                        "tunnel); they answer only to 127.0.0.1, localhost, [::1] and --host otherwise")
    p.set_defaults(func=cmd_ui)


def main(argv: list[str] | None = None) -> int:
    # Status lines (stdout) and log lines (stderr) in the order they happen, also when piped.
    sys.stdout.reconfigure(line_buffering=True)
    parser = build_parser()  # still under the quiet Ctrl-C of the loading: nothing is started before the try
    args = parser.parse_args(argv)
    try:
        # Loaded and parsed: Ctrl-C is KeyboardInterrupt again, caught below until a command sets up its own stop.
        # Inside the try: a Ctrl-C that came while argparse read the arguments printed a traceback (a loaded suite
        # run, 2026-12-05).
        if signal.getsignal(signal.SIGINT) is quiet_exit_while_loading:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.auto_resume:
            return cmd_auto_resume(args.auto_resume, daemon=not args.no_daemon, ui_port=args.ui_port,
                                   ui_host=args.ui_host)
        if not args.command:
            parser.print_help()
            return 2
        return args.func(args)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command set up its own stop (while Python still imports)
        print("stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gguf-trainer status DIR | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # library errors already name the file/key and the fix
        if isinstance(exc, UserError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        project = getattr(args, "project", None) or args.auto_resume
        # A read-only folder, a missing permission or a full disk: one line, whichever command met it.
        problem = dagster_storage_problem(project, exc) or os_refusal_message(
            exc, project=project, command="auto-resume" if args.auto_resume else args.command)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        raise


