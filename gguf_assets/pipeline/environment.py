"""Which project a Dagster process works on, from its environment (no path is stored in the instance)."""

import os
from pathlib import Path

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import PROJECT_FILE

PROJECT_ENV = "GGUF_ASSETS_PROJECT"
# Dagster mirrors a step's console lines to the terminal through a `tail -F` of its compute log, and ends the tail
# as the step ends: on a busy machine the tail can be ended before it copied the step's last line, which for a
# failed step is its one-line reason (seen once in the suite: dagster-io/dagster#23336). Dagster's own setting waits
# this long first, at the end of each step; a value in the environment wins.
STEP_LOG_TAIL_WAIT_ENV = "DAGSTER_COMPUTE_LOG_TAIL_WAIT_AFTER_FINISH"
STEP_LOG_TAIL_WAIT_S = "0.25"


def let_step_lines_reach_the_console() -> None:
    """In every process that executes a step (each loads the definitions first): see STEP_LOG_TAIL_WAIT_ENV."""
    os.environ.setdefault(STEP_LOG_TAIL_WAIT_ENV, STEP_LOG_TAIL_WAIT_S)


class EnvironmentMismatch(UserError, RuntimeError):
    """DAGSTER_HOME is not the instance of the project that GGUF_ASSETS_PROJECT names."""


def project_dir_from_env() -> str | None:
    """The project folder: GGUF_ASSETS_PROJECT, else the folder that holds DAGSTER_HOME (<project>/.dagster).

    So `DAGSTER_HOME=<project>/.dagster dagster asset materialize ...` is all the Dagster CLI needs,
    and a copied project's instance always points at the copy. When both are set they must belong
    together: otherwise a run would write one project's files and record itself in another's
    instance, where no status, resume or stale mark could find it.
    """
    home = os.environ.get("DAGSTER_HOME")
    if os.environ.get(PROJECT_ENV):
        project = Path(os.environ[PROJECT_ENV])
        own_home = ProjectPaths.of(project).dagster_home
        if home and (project / PROJECT_FILE).is_file() and Path(home).resolve() != own_home:
            raise EnvironmentMismatch(
                f"DAGSTER_HOME={home} is not the instance of the project {PROJECT_ENV}={project} (that is "
                f"{own_home}). Set both for one project: `eval \"$(gguf-trainer env {project})\"`, or unset "
                f"{PROJECT_ENV} to use the project that holds DAGSTER_HOME.")
        return str(project)
    if home and (Path(home).parent / PROJECT_FILE).is_file():
        return str(Path(home).resolve().parent)
    return None
