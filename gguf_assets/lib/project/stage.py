"""A stage of the pipeline as one record, and the one decision of its state.

Each stage's record lives in the torch-free module of its stage (materials_run.MATERIALS_STAGE, corpus_run,
shards_run, training_run, export_run, report_run); lib/status/stages.py lists them in pipeline order and
lib/status/states.py asks each for its state. A record holds the stage's name and title, the file that records
its result, its slice of project.yaml, its fingerprint (from its inputs' fingerprints, through the question's
Chain) and its state with why. Most stages take their state from ``recorded_state``: current, else missing, else
damaged, else stale with why (the decision written once); the shards and the adapter have their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.console import fill
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import DamagedRecord, read_record, recorded, recorded_fingerprint
from gguf_assets.lib.project.settings import Settings

T = TypeVar("T")


class State(StrEnum):
    """A stage's state, as `status`, the studio and the UI print it (a str: printed and in JSON as its value)."""

    CURRENT = "current"
    MISSING = "missing"  # never made
    PARTIAL = "partial"  # some of it made: shards, or training up to a checkpoint
    DAMAGED = "damaged"  # made, but its record or its files are broken
    STALE = "stale"  # made under other settings, or an input changed
    BLOCKED = "blocked"  # waits for an earlier stage
    RUNNING = "running"  # a run works on it now (with_running)


@dataclass(frozen=True)
class StageState:
    stage: str
    state: State
    # Why: for a stale stage, the project.yaml keys that changed (old → new) or what changed on disk;
    # for a damaged or partial one, what was found.
    detail: str = ""
    # Unfinished because project.yaml was edited, though no result is replaced (training.steps raised after a
    # finished run): new work, which waits for Run like a stale stage does.
    by_edit: bool = False
    # ``detail`` without what `gguf-trainer run` would do: what with_running shows while a run does it ("" when
    # detail says nothing of the kind).
    fact: str = ""

    @property
    def resumable(self) -> bool:
        """Whether `run` and the daemon's resume sensor continue it by themselves (see RESUMABLE)."""
        return self.state in RESUMABLE and not self.by_edit

    def console_text(self) -> str:
        """The stage as `status` prints it: name, state and why, the why wrapped under its own column."""
        return fill(f"  {self.stage:<12} {self.state:<8} {self.detail}".rstrip(), hanging=22)


# The states `run` and the daemon continue by themselves: nothing the user decided differs from what
# was asked. A stale stage waits for the user after a settings edit (pipeline/resume.py).
RESUMABLE = (State.MISSING, State.PARTIAL, State.DAMAGED)
UNFINISHED = (*RESUMABLE, State.STALE)


class Chain:
    """One status question: the project, its settings, and what the stages compute on the way (the materials
    manifest, the shard plans, each stage's fingerprint), each computed once, when first asked."""

    def __init__(self, paths: ProjectPaths, settings: Settings, stages: dict[str, Stage]) -> None:
        self.paths, self.settings, self.stages = paths, settings, stages
        self.known: dict[str, Any] = {}

    def once(self, key: str, compute: Callable[[], T]) -> T:
        if key not in self.known:
            self.known[key] = compute()
        return self.known[key]

    def fingerprint(self, stage: str) -> str:
        """``stage``'s fingerprint as made now: from its inputs' fingerprints, each computed once."""
        return self.once(f"fingerprint:{stage}", lambda: self.stages[stage].fingerprint(self))


def _no_blocker(settings: Settings) -> str:
    return ""


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline (see the module's docstring)."""

    name: str
    title: str  # as people read it: the studio's stage table, its Run preview and outdated-result line
    record: Callable[[ProjectPaths, Settings], Path]  # the JSON file that records its result
    settings: Callable[[Settings], dict]  # its slice of project.yaml: what its result is computed from
    fingerprint: Callable[[Chain], str]  # its fingerprint as made now, from its inputs' (chain.fingerprint)
    # Whether its result on disk is current (recorded_state's first question).
    is_current: Callable[[Chain], bool] = lambda chain: False
    stale_because: str = ""  # why it is stale when none of its own settings changed (an input or a file did)
    # Said when the record holds today's fingerprint but the stage is not current: its files changed on disk.
    files_changed: str = ""
    # Its state with why; recorded_state unless the stage has its own (the shards', the adapter's).
    state: Callable[[Stage, Chain], StageState] | None = None
    # Why this stage and every later one cannot run under these settings ("" when they can).
    blocked_by: Callable[[Settings], str] = _no_blocker

    def state_of(self, chain: Chain) -> StageState:
        return (self.state or recorded_state)(self, chain)


def recorded_state(stage: Stage, chain: Chain) -> StageState:
    """The state of a stage that one JSON record stands for: current, missing, damaged or stale, with why."""
    if stage.is_current(chain):
        return StageState(stage.name, State.CURRENT)
    record = stage.record(chain.paths, chain.settings)
    if not record.is_file():
        return StageState(stage.name, State.MISSING)
    if damage := record_damage(chain.paths, record):
        return StageState(stage.name, State.DAMAGED, damage)
    if stage.files_changed and recorded_fingerprint(record) == chain.fingerprint(stage.name):
        return StageState(stage.name, State.DAMAGED, stage.files_changed)
    return StageState(stage.name, State.STALE, why_stale(chain, stage, record, stage.stale_because))


def record_damage(paths: ProjectPaths, record: Path) -> str:
    """What is wrong with a stage's JSON record, or "" when it reads."""
    try:
        read_record(record)
    except DamagedRecord as exc:
        return f"{paths.stored(record)}: {exc.why}"
    except OSError as exc:
        return f"{paths.stored(record)}: {exc.strerror}"
    return ""


def why_stale(chain: Chain, stage: Stage, record: Path, otherwise: str) -> str:
    """The settings keys whose change made ``stage`` stale, old → new, from the snapshot its ``record`` names
    (lib/project/settings_history.py); ``otherwise`` when none of its own settings changed (an input or a file did)."""
    old = settings_history.recall(chain.paths.root, recorded(record, "settings_hash"))
    if old is not None:
        keys = settings_history.changed_keys(old, chain.settings, stage.settings)
        if keys:
            return ", ".join(keys)
    return otherwise


def older_format(record: Path, kind: str) -> str | None:
    """How a record of an older format was made (formats.older_format), or None."""
    try:
        return formats.older_format(kind, atomic.read_json(record))
    except (OSError, ValueError, AttributeError):
        return None
