"""The Definitions load, and lib/ stays free of dagster."""

import ast
from pathlib import Path

import dagster as dg

import gguf_assets

LIB = Path(gguf_assets.__file__).parent / "lib"


def test_definitions_load_with_every_asset_and_group():
    from gguf_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    stages = {"materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report"}
    assert keys == stages | {f"settings/{s}" for s in stages}
    # Each stage reads its own settings, observed from project.yaml (no reload of the definitions).
    for stage in stages:
        assert dg.AssetKey(["settings", stage]) in graph.get(dg.AssetKey(stage)).parent_keys
        assert graph.get(dg.AssetKey(["settings", stage])).is_observable
    groups = {k.to_user_string(): graph.get(k).group_name for k in graph.get_all_asset_keys()}
    # The UI sorts groups by name: the names follow the pipeline, settings first.
    in_pipeline_order = [groups[a] for a in ("settings/materials", "materials", "corpus", "train_shards", "adapter",
                                             "eval_report")]
    assert in_pipeline_order == sorted(set(groups.values())) and groups["gguf"] == groups["eval_report"]
    assert graph.get(next(k for k in graph.get_all_asset_keys() if k.to_user_string() == "adapter")).pools == {"gpu"}


def test_named_jobs_checks_and_sensors():
    from gguf_assets.definitions import defs

    assert {j.name for j in defs.jobs} >= {"materials_and_corpus", "precompute_train_shards",
                                          "precompute_val_shards", "train_export_evaluate"}
    checks = {f"{k.asset_key.to_user_string()}:{k.name}" for c in defs.asset_checks for k in c.check_keys}
    checks |= {f"{k.asset_key.to_user_string()}:{k.name}" for a in defs.assets if hasattr(a, "check_keys")
               for k in a.check_keys}
    assert checks == {"train_shards:shards_verified", "val_shards:shards_verified", "gguf:exported_files_unchanged",
                      "eval_report:gguf_agrees_with_torch", "eval_report:val_centred_cosine_threshold",
                      "eval_report:prompt_retrieval_above_chance", "eval_report:reported_files_unchanged"}
    assert {s.name for s in defs.sensors} == {"interrupted_runs_sensor", "resume_pipeline_sensor"}


def test_lib_never_imports_dagster():
    offenders = []
    files = list(LIB.rglob("*.py"))
    assert len(files) > 40  # every stage's subpackage
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{file.name}: {n}" for n in names if n.split(".")[0] == "dagster"]
    assert offenders == []


def test_settings_reference_doc_is_generated_from_the_schema():
    from gguf_assets.docs import SETTINGS_DOC
    from gguf_assets.lib.project.settings import settings_reference_markdown

    assert SETTINGS_DOC.read_text(encoding="utf-8") == settings_reference_markdown() + "\n", (
        "docs/settings.md is out of date: run `python -m gguf_assets.docs`")


def test_the_gguf_layout_key_tables_are_generated_from_the_format_module():
    import pytest

    from gguf_assets.docs import GGUF_LAYOUT_DOC, gguf_layout_markdown, with_generated_regions

    assert GGUF_LAYOUT_DOC.read_text(encoding="utf-8") == gguf_layout_markdown(), (
        "docs/gguf_layout.md's key tables are out of date: run `python -m gguf_assets.docs`")
    with pytest.raises(ValueError, match="provenance keys"):  # a table whose markers were lost is no silent skip
        with_generated_regions("no markers here", {"provenance keys": "| x |"})


def test_hardware_and_environment_panels_describe_this_machine():
    from gguf_assets.defs.panels import panel_metadata
    from gguf_assets.lib.telemetry.hardware import hardware_report

    hw = hardware_report()
    assert hw["ram_gib"] > 0 and hw["cpu_threads"] >= 1
    panels = panel_metadata()
    assert "RAM" in panels["hardware"].value and "torch" in panels["environment"].value
    gpu_rows = [line for line in panels["hardware"].value.splitlines() if line.startswith("| GPU")]
    assert len(gpu_rows) == max(1, len(hw["gpus"])) and set(panels) == {"hardware", "environment"}


def test_a_typo_in_project_yaml_leaves_the_code_location_loaded_with_the_message_reachable(make_project):
    """A typo must not turn the code location into an error (every asset page would show "–"): the
    definitions load through Dagster's own loader, and the message (file:line, did you mean) is in
    the resume sensor's skip reason and in the failed settings observation."""
    import os
    import subprocess
    import sys

    from conftest import cli_env, project_instance

    from gguf_assets.defs.settings import SETTINGS_ASSETS
    from gguf_assets.pipeline.resume import resume_decision

    paths = make_project(steps=5, mock_teacher=True)
    text = paths.project_file.read_text()
    assert "  learning_rate:" in text
    paths.project_file.write_text(text.replace("  learning_rate:", "  learning_rat:"))
    instance = project_instance(paths)  # DAGSTER_HOME and the project now point at this project
    env = cli_env(DAGSTER_HOME=os.environ["DAGSTER_HOME"], GGUF_ASSETS_PROJECT=str(paths.root))
    done = subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-m", "gguf_assets.definitions"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    skip = resume_decision(instance)
    assert isinstance(skip, dg.SkipReason)
    assert "project.yaml:" in skip.skip_message and "learning_rate" in skip.skip_message, skip.skip_message
    observe = dg.Definitions(assets=[SETTINGS_ASSETS[0]], jobs=[dg.define_asset_job(
        "observe", selection=[SETTINGS_ASSETS[0].key])]).resolve_job_def("observe")
    result = observe.execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.step_failure_data.user_failure_data.description
    assert "project.yaml:" in message and "learning_rat" in message, message


def test_a_dagster_home_of_another_project_is_refused_naming_both(make_project):
    """`eval "$(gguf-trainer env A)"`, then DAGSTER_HOME=B/.dagster: `dagster asset materialize` used to
    write A's files and record the run in B's instance. It refuses to start, naming both, in one line."""
    import subprocess
    import sys

    from conftest import cli_env, project_instance

    a, b = make_project(steps=5, mock_teacher=True), make_project(steps=5, mock_teacher=True)
    project_instance(b)  # B's instance exists, as after any gguf-trainer command on B
    env = cli_env(GGUF_ASSETS_PROJECT=str(a.root), DAGSTER_HOME=str(b.dagster_home))
    done = subprocess.run([sys.executable, "-m", "dagster", "asset", "materialize", "-m", "gguf_assets.definitions",
                           "--select", "materials"], capture_output=True, text=True, env=env, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Traceback" not in out, out
    line = next(x for x in out.splitlines() if x.startswith("error: "))
    assert f"DAGSTER_HOME={b.dagster_home}" in line and f"GGUF_ASSETS_PROJECT={a.root}" in line, line
    assert not a.materials_manifest.exists() and not a.dagster_home.exists()
    assert project_instance(b).get_run_records() == []


ROOT = Path(gguf_assets.__file__).parent.parent
PACKAGE_NAME = "gguf_assets"


def _python_files():
    for folder in ("gguf_assets", "gguf_assets_tests", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")


def test_dagster_private_api_is_used_in_one_module_only():
    """Dagster's private modules are imported only by pipeline/private_api.py, which says why for each."""
    offenders = []
    for file in _python_files():
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{file.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.startswith("dagster._")]
    assert all(o.startswith("gguf_assets/pipeline/private_api.py:") for o in offenders), offenders
    assert offenders  # the one module is where they are


def _import_graph() -> dict[str, set[str]]:
    """gguf_assets' modules and the modules of the package each imports, at any level (functions too)."""
    package = ROOT / PACKAGE_NAME
    modules = {}
    for file in package.rglob("*.py"):
        name = ".".join(file.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = file
    graph = {}
    for name, file in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} & modules.keys()
                deps |= {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names} & modules.keys()
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles_counting_imports_inside_functions():
    graph = _import_graph()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, cycles[:5]
    # The check sees function-level imports: the instance opens the code location inside a function.
    assert "gguf_assets.pipeline.private_api" in graph["gguf_assets.orchestration.instance"]


# What the CLI, the studio and orchestration/ may take from defs/: nothing. The names and the runtime code the
# definitions and the drivers share are on the floor below both, pipeline/ (names, partitions, environment, the
# settings observation, run tags, the plan, resume, the in-run bookkeeping, Dagster's private API); defs/ holds
# definitions only, which gguf_assets.definitions gathers. Each entry added here would say what is taken.
DEFS_OTHERS_MAY_IMPORT: dict[str, str] = {}


def test_defs_hold_definitions_and_the_cli_studio_and_orchestration_take_only_their_names():
    graph = _import_graph()
    outside = [m for m in graph if not m.startswith("gguf_assets.defs") and m != "gguf_assets.definitions"]
    taken = {(m, d) for m in outside for d in graph[m] if d.startswith("gguf_assets.defs.")}
    assert {d for _, d in taken} <= DEFS_OTHERS_MAY_IMPORT.keys(), sorted(
        (m, d) for m, d in taken if d not in DEFS_OTHERS_MAY_IMPORT)
    # Every module under defs/ is part of the definitions (imported, at some depth, by definitions.py).
    reached, todo = set(), ["gguf_assets.definitions"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph.get(module, ())
    assert {m for m in graph if m.startswith("gguf_assets.defs.")} <= reached


# lib/'s packages from the bottom up: each may import only those before it, at module level and inside
# functions. The stages follow the data (materials → corpus → precompute → training → output) on the
# foundation (core, then project: settings, layout, contracts); telemetry (hardware, progress, curves) imports
# nothing of lib/, and the precompute and training use it, so it sits right above core; status composes every
# stage's fingerprint and check; planning (memory and time) reads the status's measured pace, and runs (list,
# label, delete, use, compare the training runs) its stages and states; the demo builds materials and settings
# for `gguf-trainer demo` and the tests, and nothing in lib/ may depend on it.
LIB_LAYERS = ("core", "telemetry", "project", "materials", "corpus", "precompute", "training", "output", "status",
              "planning", "runs", "demo")


def _lib_imports_against_the_layers(lib: Path) -> list[str]:
    """Every import in ``lib`` (a gguf_assets/lib folder) of a lib package that is not below the importer's own
    package in LIB_LAYERS, as "file:line importer -> imported (module)"."""
    rank = {name: i for i, name in enumerate(LIB_LAYERS)}
    prefix = f"{PACKAGE_NAME}.lib"
    against = []
    for file in sorted(lib.rglob("*.py")):
        parts = file.relative_to(lib).parts
        if len(parts) < 2:  # lib/__init__.py
            continue
        importer = parts[0]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against the importing module's package
                    base = [PACKAGE_NAME, "lib", *parts[:-1]][: 2 + len(parts) - node.level]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from gguf_assets.lib import status` names the package in the imported names
                modules = [f"{module}.{a.name}" for a in node.names] if module == prefix else [module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                if not module.startswith(prefix + "."):
                    continue
                imported = module.split(".")[2]
                if imported != importer and rank.get(imported, len(rank)) >= rank.get(importer, -1):
                    against.append(f"{file.relative_to(lib)}:{node.lineno} {importer} -> {imported} ({module})")
    return against


def test_lib_packages_import_only_the_layers_below_them():
    packages = {p.name for p in LIB.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LIB_LAYERS), "place a new lib/ package in LIB_LAYERS"
    assert _lib_imports_against_the_layers(LIB) == []


def test_the_layer_check_finds_an_import_against_the_order(tmp_path):
    """The check sees imports inside functions, relative ones and a package imported by name."""
    lib = tmp_path / "lib"
    for package in ("core", "project", "output", "status"):
        (lib / package).mkdir(parents=True)
        (lib / package / "__init__.py").write_text("")
    (lib / "core" / "atomic.py").write_text("def f():\n    from gguf_assets.lib.status.states import State\n")
    (lib / "project" / "layout.py").write_text("from ..output import export\nfrom gguf_assets.lib import status\n")
    (lib / "output" / "export.py").write_text("import gguf_assets.lib.core.atomic\nfrom ..project import layout\n")
    (lib / "status" / "states.py").write_text("from gguf_assets.lib.output import export\n")
    assert _lib_imports_against_the_layers(lib) == [
        "core/atomic.py:2 core -> status (gguf_assets.lib.status.states)",
        "project/layout.py:1 project -> output (gguf_assets.lib.output)",
        "project/layout.py:2 project -> status (gguf_assets.lib.status)",
    ]


def test_bookkeeping_tags_are_hidden_from_the_runs_list_and_the_others_shown():
    from gguf_assets.pipeline import run_tags
    from gguf_assets.pipeline.private_api import TagType, get_tag_type

    assert all(get_tag_type(tag) == TagType.HIDDEN for tag in run_tags.HIDDEN_TAGS)
    for shown in (run_tags.WORKER_TAG, run_tags.INTERRUPTED_TAG, run_tags.STOPPED_TAG):
        assert get_tag_type(shown) == TagType.USER_PROVIDED
    # A run an earlier version tagged is still read.
    assert run_tags.get({"gguf_assets/pid": "12"}, run_tags.PID_TAG) == "12"
    assert run_tags.get({run_tags.PID_TAG: "13", "gguf_assets/pid": "12"}, run_tags.PID_TAG) == "13"


def test_processes_opening_a_new_project_instance_at_once_all_get_it(tmp_path):
    """Dagster creates its SQLite tables on first open, unguarded, so two processes opening a new instance
    at once collided ('table alembic_version already exists': a `run` and a status read, in a test under
    load). prepare_instance creates them once, under a lock, before anyone opens the instance."""
    import subprocess
    import sys

    from gguf_assets.lib.project.layout import ProjectPaths

    # One process imports, then forks into four that open the instance at the same moment (a shared start time):
    # the race once took two fresh projects of processes started at once to happen by chance. Forked after the
    # imports, so the four cost one import (about 3 CPU s) instead of four.
    opener = "\n".join([
        "import os, pathlib, sys, time",
        "import dagster as dg",
        "from gguf_assets.lib.project.layout import ProjectPaths",
        "from gguf_assets.orchestration.instance import prepare_instance",
        "go = time.time() + 0.5",
        "children = []",
        "for _ in range(3):",
        "    pid = os.fork()",
        "    if pid == 0:",
        "        children = None",
        "        break",
        "    children.append(pid)",
        "time.sleep(max(0.0, go - time.time()))",
        "prepare_instance(ProjectPaths.of(sys.argv[1]))",
        "dg.DagsterInstance.get().get_runs()",
        "if children is None:",
        "    sys.stdout.flush()",
        "    os._exit(0)",
        "failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]",
        "print('ok' if not failed else f'{len(failed)} of 4 failed')"])
    root = tmp_path / "project"
    root.mkdir()
    done = subprocess.run([sys.executable, "-c", opener, str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert (ProjectPaths.of(root).dagster_home / "history").is_dir()


def test_the_top_level_dagster_yaml_is_the_packaged_template():
    """dagster.yaml at the top (what `dagster dev` in the checkout reads) and gguf_assets/dagster.yaml (the template
    each project's instance is rendered from, shipped in the package) are one file in two places: tied here."""
    root = Path(__file__).resolve().parents[2]
    assert (root / "dagster.yaml").read_bytes() == (root / "gguf_assets" / "dagster.yaml").read_bytes(), (
        "dagster.yaml and gguf_assets/dagster.yaml differ: change both (the package's is the one projects use)")


# The packages above lib/, from the bottom up: each may import only those before it (and lib/), at module level and
# inside functions. gguf_assets.definitions, the code location's entry, stands with defs/.
TOP_LAYERS = ("pipeline", "defs", "orchestration", "cli", "studio")


def _top_imports_against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(TOP_LAYERS)}

    def layer(module: str) -> str | None:
        parts = module.split(".")
        if module == f"{PACKAGE_NAME}.definitions":
            return "defs"
        return parts[1] if len(parts) > 1 and parts[1] in rank else None

    against = []
    for module, deps in graph.items():
        own = layer(module)
        if own is None:
            continue
        for dep in deps:
            other = layer(dep)
            if other is not None and other != own and rank[other] > rank[own]:
                against.append(f"{module} ({own}) -> {dep} ({other})")
    return sorted(against)


def test_the_top_packages_import_only_the_layers_below_them_and_lib_imports_none_of_them():
    graph = _import_graph()
    packages = {p.name for p in (ROOT / PACKAGE_NAME).iterdir() if (p / "__init__.py").is_file()} - {"lib"}
    assert packages == set(TOP_LAYERS), "place a new top package in TOP_LAYERS"
    assert _top_imports_against_the_layers(graph) == []
    from_lib = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(f"{PACKAGE_NAME}.lib.")
                      for d in deps if d.split(".")[1:2] and d.split(".")[1] in TOP_LAYERS)
    assert from_lib == []


def test_the_top_layer_check_finds_an_import_against_the_order():
    graph = {"gguf_assets.pipeline.plan": {"gguf_assets.orchestration.launching"},
             "gguf_assets.cli.commands": {"gguf_assets.pipeline.plan", "gguf_assets.studio.app"},
             "gguf_assets.definitions": {"gguf_assets.defs.jobs", "gguf_assets.cli.commands"}}
    assert _top_imports_against_the_layers(graph) == [
        "gguf_assets.cli.commands (cli) -> gguf_assets.studio.app (studio)",
        "gguf_assets.definitions (defs) -> gguf_assets.cli.commands (cli)",
        "gguf_assets.pipeline.plan (pipeline) -> gguf_assets.orchestration.launching (orchestration)",
    ]


def test_every_process_that_loads_the_definitions_lets_a_step_s_last_line_reach_the_console(tmp_path):
    """Dagster ends the `tail` that mirrors a step's lines to the terminal as the step ends, which once cut a failed
    step's one-line reason from the console (test_console.py). Every process that executes a step loads the
    definitions first, which set Dagster's own wait for that tail; a value the user set stays, and this Dagster still
    reads the setting where it ends the tail."""
    import os
    import subprocess
    import sys

    from gguf_assets.pipeline.environment import STEP_LOG_TAIL_WAIT_ENV, STEP_LOG_TAIL_WAIT_S

    # Read as text, not imported: Dagster's private modules are private_api.py's alone.
    tail = (Path(dg.__file__).parent / "_core" / "execution" / "compute_logs.py").read_text()
    assert f'os.getenv("{STEP_LOG_TAIL_WAIT_ENV}"' in tail
    code = f"import os, gguf_assets.definitions; print(os.environ[{STEP_LOG_TAIL_WAIT_ENV!r}])"
    base = {k: v for k, v in os.environ.items()
            if k not in (STEP_LOG_TAIL_WAIT_ENV, "GGUF_ASSETS_PROJECT", "DAGSTER_HOME")}
    for preset, expected in ((None, STEP_LOG_TAIL_WAIT_S), ("2", "2")):
        env = dict(base, **({STEP_LOG_TAIL_WAIT_ENV: preset} if preset else {}))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stdout + done.stderr
    assert float(STEP_LOG_TAIL_WAIT_S) < 1  # paid at the end of every step
