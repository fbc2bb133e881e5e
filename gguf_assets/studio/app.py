"""The studio's web app (Starlette, which dagster-webserver already brings, with Jinja2 templates).

One project per app. The studio is three rooms:
- page.py: the page's contract, PageView (what the page renders and the JSON its script reads);
- views.py: the functions that build each panel's data from the same truths the CLI prints;
- routes.py: the Starlette handlers, and ``Studio``, what they keep between requests.

Nothing here keeps state of its own (the observations it has read are a cache: the instance holds them).
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette

from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.studio.page import PageView
from gguf_assets.studio.routes import RUN_ARGS, RUN_LOG, Studio, exception_handlers, routes
from gguf_assets.studio.spare_run import SpareRun
from gguf_assets.studio.views import (
    LiveHardware,
    ObservationFeed,
    memory_view,
    project_view,
    report_view,
    run_preview,
    snapshots_view,
    training_view,
)

# The names the tests and `gguf-trainer ui` take from here; each lives in its room.
__all__ = ["LiveHardware", "ObservationFeed", "PageView", "Studio", "build_app", "memory_view", "project_view",
           "report_view", "run_preview", "snapshots_view", "training_view"]


def build_app(project: str | Path, *, dagster_url: str = "", tensorboard_url: str = "",
              spare_run: bool = False) -> Starlette:
    """The studio of ``project``. ``spare_run``: keep a run process loaded ahead while nothing runs, so Run shows
    the first training step seconds sooner (studio/spare_run.py; `gguf-trainer ui` turns it on)."""
    paths = ProjectPaths.of(project)
    studio = Studio(paths, dagster_url, tensorboard_url,
                    spare=SpareRun(paths.root, paths.dagster_home / RUN_LOG, RUN_ARGS) if spare_run else None)
    return Starlette(exception_handlers=exception_handlers(), routes=routes(studio))
