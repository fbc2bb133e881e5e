"""The page's contract: what the studio page (templates/project.html) is rendered from and what its script reads.

PageView is everything the live panels show, one record: the page renders it, and /api/status serves it as JSON
(``PageView.to_json``: its field names are the keys the page's script reads). The views that fill it are views.py's,
the routes that serve it routes.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from markupsafe import Markup, escape
from starlette.templating import Jinja2Templates

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


@dataclass(frozen=True)
class PageView:
    """The page's contract: everything its live panels show, one record. The page renders it
    (templates/project.html reads these fields) and /api/status serves it as JSON (``to_json``: these names are
    the JSON keys the page's script reads). Each field is JSON already (the panels' own dicts and lists)."""

    project: str
    settings_error: str | None = None  # project.yaml's error while it does not load (the rest: the last good view)
    stages: list[dict] = field(default_factory=list)  # {stage, title, state, detail}, in pipeline order
    busy: str | None = None  # what holds the project lock, in its own words
    running: dict | None = None  # {run_id, job}: the Dagster run inside it
    run_preview: str = ""  # what Run would do now, one line
    last_run: dict | None = None  # studio/last_run.py's view of the newest Dagster run
    training: dict | None = None  # the Training metrics panel (training_view)
    snapshots: dict | None = None  # the Snapshots list (snapshots_view)
    precompute: list[dict] = field(default_factory=list)  # the precompute progress rows
    pace: list[str] = field(default_factory=list)  # the precompute's speed and ETA (training's: in ``training``)
    hardware_now: dict = field(default_factory=dict)  # the machine's load now (LiveHardware)
    report: dict | None = None  # the verdict and the exported files, marked "outdated" when made earlier
    run_command: str = ""  # the command Run runs
    signal: dict = field(default_factory=dict)  # the title and the state a notification follows (page_signal.py)

    def to_json(self) -> dict:
        """/api/status's answer: the fields by name, in this order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def inline_code(text: str) -> Markup:
    """A message of the product for the page: escaped, its `...` spans (Markdown's code, which report.md renders)
    shown as code rather than as backticks."""
    return Markup(re.sub(r"`([^`]*)`", r"<code>\1</code>", str(escape(text))))

