"""`gguf-trainer runs DIR`: the project's training runs as a table, and --diff, --use, --delete, --label and
--compare (lib/runs/ does the work; this prints it)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.console import WIDTH, fill
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.lock import holder
from gguf_assets.lib.core.metrics import (
    COMPARED,
    RETRIEVAL_SCORES,
    RETRIEVAL_TOP,
    VAL_CENTRED_COSINE,
    VAL_RETRIEVAL_PROMPTS,
    WORST_ROW,
    WORST_ROW_COSINE,
    retrieval_chance,
)
from gguf_assets.lib.core.units import bytes_text
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.runs.changes import delete_run, label_run, use_run
from gguf_assets.lib.runs.compare import compare_scores
from gguf_assets.lib.runs.listing import (
    RunsError,
    RunState,
    default_compared,
    find_run,
    lineage_lines,
    read_runs,
    shown_value,
)
from gguf_assets.lib.status.states import project_status, with_running
from gguf_assets.lib.telemetry.progress import format_seconds

DIFF_KEYS_SHOWN = 2  # in the table's "vs project.yaml" column; --diff RUN lists them all
COMPARE_SVG = "checkpoints/compare.svg"  # --compare's curves, in the project beside the runs' folders


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list the training runs (scores, settings diff, disk); use, delete, label or "
                                    "compare them",
                       # argparse prints a group of exclusive options on one line, however long: 109 columns here
                       usage="%(prog)s [-h] [--json] project\n"
                             "         [--diff RUN | --use RUN | --delete RUN | --label RUN TEXT |\n"
                             "          --compare RUN [RUN ...] [--svg FILE]]")
    p.add_argument("project")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--diff", metavar="RUN", help="the run's settings against project.yaml, key by key")
    what.add_argument("--use", metavar="RUN", help="set project.yaml's keys that decide the run's result back to "
                                                   "its values, and make its GGUF and report current (no training)")
    what.add_argument("--delete", metavar="RUN", help="remove the run's folder (never the current run's)")
    what.add_argument("--label", nargs=2, metavar=("RUN", "TEXT"), help="give the run a label (\"\" removes it)")
    what.add_argument("--compare", nargs="*", metavar="RUN",
                      help="runs' scores step by step (val centred cosine, relative MSE, cosine after RMSNorm, worst "
                           "query row, empty prompt) and at their last validation, and their GGUF's (prompt retrieval "
                           "too); the curves go to an SVG. A RUN may be a snapshot, compared like a run (its run's "
                           "curve to its step, its GGUF's evaluation): its file's name (demo-adapter-step35.gguf) or "
                           "RUN@STEP. No RUN: the newest run and the one it continues (else the best other)")
    p.add_argument("--svg", metavar="FILE", help="with --compare: write the curves, one chart per score, to FILE "
                                                 f"(default: {COMPARE_SVG} in the project; its path is printed)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON (for tools)")
    p.set_defaults(func=cmd_runs)


class NoProject(UserError):
    pass


def cmd_runs(args: argparse.Namespace) -> int:
    paths = ProjectPaths.of(args.project)
    if not paths.project_file.is_file():
        raise NoProject(f"{paths.project_file} does not exist: pass a project folder (`gguf-trainer init DIR` makes "
                        "one)")
    if args.svg and args.compare is None:
        raise RunsError("--svg goes with --compare [RUN...]")
    if args.use:
        return _use(paths, args.use, as_json=args.json)
    if args.delete:
        deleted = delete_run(paths, args.delete)
        _out(args.json, {"deleted": deleted.name, "fingerprint": deleted.fingerprint,
                         "freed_bytes": deleted.freed_bytes},
             f"deleted run {deleted.name}: freed {bytes_text(deleted.freed_bytes)}")
        return 0
    if args.label:
        run = label_run(paths, *args.label)
        _out(args.json, run.to_json(), f"labelled {run.name}: {run.label!r}" if run.label
             else f"{run.name} has no label now")
        return 0
    view = read_runs(paths)
    if args.diff:
        return _diff(paths, find_run(view, args.diff), as_json=args.json)
    if args.compare is not None:
        refs = args.compare or [r.fingerprint for r in default_compared(view)]
        if not refs:
            raise RunsError(f"{paths.root} has no training runs to compare yet: "
                            f"`{trainer('run', paths.root)}` trains one")
        return _compare(paths, view, refs, svg=args.svg, as_json=args.json)
    if args.json:
        print(json.dumps(view.to_json(), indent=2))
        return 0
    _table(paths, view)
    return 0


def say(text: str) -> None:
    """A line of the console, wrapped to 80 columns (a command in backticks stays whole)."""
    print(fill(text))


def _out(as_json: bool, doc: dict, text: str) -> None:
    print(json.dumps(doc, indent=2) if as_json else text)


def _score(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _chance(prompts: int | None) -> str:
    if not prompts:
        return "-"
    return f"{retrieval_chance(prompts):.3f} / {retrieval_chance(prompts, RETRIEVAL_TOP):.3f}"


def _vs_settings(run) -> str:
    if run.made_by_settings:
        return "same"
    if run.diff is None:
        return "? (settings not recorded)"
    keys = [d for d in run.diff if d.result]
    if not keys:
        return "same settings, other shards"
    shown = [f"{d.key}={shown_value(d.run)}" for d in keys[:DIFF_KEYS_SHOWN]]
    return ", ".join(shown) + (f" +{len(keys) - DIFF_KEYS_SHOWN} more" if len(keys) > DIFF_KEYS_SHOWN else "")


def _table(paths: ProjectPaths, view) -> None:
    """The runs, one block each (a table of ten columns would be 240 wide): the name and label, then the
    scores, the time and disk it took, and how it stands against the output folder and project.yaml."""
    if not view.runs:
        say(f"{paths.root} has no training runs yet: `{trainer('run', paths.root)}` trains one")
    for r in view.runs:
        wall = "-" if r.train_seconds is None else ("~" if r.seconds_estimated else "") + format_seconds(
            r.train_seconds)
        now = ", ".join(w for w, on in (("current", r.current), ("project.yaml", r.made_by_settings)) if on)
        best = "-" if r.best_val_centred_cosine is None else f"{r.best_val_centred_cosine:.4f} (step {r.best_step})"
        say(r.name + (f"  label: {r.label}" if r.label else ""))
        say(f"    {r.state}, {r.step}/{r.steps if r.steps else '?'} steps; best val {best}, final val "
            f"{_score(r.final_val_centred_cosine)}")
        say(f"    wall {wall}, disk {bytes_text(r.disk_bytes)}; now: {now or '-'}")
        say(f"    vs project.yaml (the run's values): {_vs_settings(r)}")
        if r.state != RunState.FINISHED:
            say(f"    {r.detail}")
        for line in lineage_lines(r, view):
            say(f"    {line}")
    if view.settings_error:
        say(f"project.yaml does not load now, so the runs are listed without their settings diff: "
            f"{view.settings_error}")
    elif view.settings_fingerprint and not any(r.made_by_settings for r in view.runs):
        say(f"project.yaml makes a run not trained yet ({view.settings_fingerprint}): "
            f"`{trainer('run', paths.root)}` trains it")
    if view.runs:
        say(f"current: its GGUF and report are in the output folder. More: `{trainer('runs', paths.root)}` with "
            "--diff RUN, --use RUN, --delete RUN, --label RUN TEXT or --compare [RUN...] (RUN: a name, its "
            "start, or a label; --compare takes snapshots too: a snapshot GGUF's name, or RUN@STEP)")


def _diff(paths: ProjectPaths, run, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"run": run.name, "fingerprint": run.fingerprint, "settings_source": run.settings_source,
                          "diff": None if run.diff is None else [d.__dict__ for d in run.diff]}, indent=2))
        return 0
    if run.diff is None:
        say(f"{run.name}: its settings were not recorded (it has no checkpoint, or its settings snapshot in "
            f".settings/ is gone), so there is nothing to compare")
        return 0
    say(f"{run.name} ({run.state}) against {paths.project_file} (its settings: {run.settings_source}):")
    if not run.diff:
        say("  the same settings" + ("" if run.made_by_settings else
                                     "; its shards differ from those project.yaml makes now (the materials or "
                                     "prompts changed since it trained)"))
    for d in run.diff:
        say(f"  {d.text()}")
    if any(d.result for d in run.diff):
        say(f"`{trainer('runs', paths.root, '--use', run.name)}` sets the keys that change a result to the run's "
            "values")
    return 0


def _use(paths: ProjectPaths, ref: str, *, as_json: bool) -> int:
    used = use_run(paths, ref)
    if as_json:
        print(json.dumps(used.to_json(), indent=2))
        return 0
    say(f"using run {used.run.name}:")
    say("  project.yaml: " + (", ".join(used.changed) if used.changed else "no change"))
    if used.left:
        say(f"  left as project.yaml has them (they change no result): {', '.join(used.left)}")
    if used.restored:
        say(f"  restored: {', '.join(used.restored)}")
    say(f"  next run: {used.next_run}")
    from gguf_assets.orchestration.runs import tell_dagster

    if (problem := tell_dagster(paths, used)) is not None:
        say(f"  {problem}")
    for s in with_running(project_status(paths, load_settings(paths.root)), holder(paths.lock_file)):
        print(s.console_text())  # as `gguf-trainer status` prints them
    return 0


def _compare_rows(runs: list, gguf_label: str) -> list[tuple[str, list[str] | None]]:
    """`runs --compare`'s table: (label, a cell per run), or (a heading, None)."""
    by_step = [dict(r.curve) for r in runs]
    rows: list[tuple[str, list[str] | None]] = [("val centred cosine by step (0: untrained)", None),
                                                ("step", [_numbered(r, n) for n, r in enumerate(runs, 1)])]
    rows += [(str(step), [_score(s.get(step)) for s in by_step]) for step in sorted(set().union(*by_step))]
    rows += [("best", ["-" if r.best_val_centred_cosine is None else f"{r.best_val_centred_cosine:.4f}@{r.best_step}"
                       for r in runs]),
             ("final", [_score(r.final_val_centred_cosine) for r in runs]),
             ("", None), ("at the last validation (raw target space; relative MSE: lower is better;", None),
             ("  a snapshot: its GGUF's evaluation, else its step's validation)", None),
             ("step", ["-" if r.last_scores.get("step") is None else str(r.last_scores["step"]) for r in runs])]
    for score in COMPARED:
        cells = []
        for r in runs:
            value = r.last_scores.get(score.key)
            text = score.text(value) if isinstance(value, (int, float)) else "-"
            if score.key == WORST_ROW_COSINE and isinstance(r.last_scores.get(WORST_ROW), int):
                text += f" (row {r.last_scores[WORST_ROW]})"
            cells.append(text)
        rows.append((score.label, cells))
    rows.append((gguf_label, [_score(r.gguf_val_centred_cosine) for r in runs]))
    # Prompt retrieval: the evaluation's only (its kept report's), with the chance each run's val prompts give.
    rows.append(("prompt retrieval of its GGUF (own target the nearest, of the val prompts)", None))
    for score in RETRIEVAL_SCORES:
        rows.append(("  " + score.label.removeprefix("prompt retrieval "),
                     [score.text(r.gguf_retrieval[score.key]) if isinstance(r.gguf_retrieval.get(score.key),
                                                                            (int, float)) else "-" for r in runs]))
    rows.append((f"  chance (top-1 / top-{RETRIEVAL_TOP})", [_chance(r.gguf_retrieval.get(VAL_RETRIEVAL_PROMPTS))
                                                             for r in runs]))
    return rows


def _print_compare_table(rows: list[tuple[str, list[str] | None]]) -> None:
    """The table with as many runs side by side as 80 columns hold, then the next runs below, and so on."""
    label = max(len(text) for text, cells in rows if cells is not None) + 2
    columns = len(next(cells for _, cells in rows if cells is not None))
    widths = [max(len(cells[i]) for _, cells in rows if cells is not None) for i in range(columns)]
    groups, group = [], []
    for i, width in enumerate(widths):
        if group and label + sum(widths[j] + 2 for j in group) + width > WIDTH:
            groups.append(group)
            group = []
        group.append(i)
    groups.append(group)
    for number, group in enumerate(groups):
        if number:
            print()
        for text, cells in rows:
            print(text if cells is None else (text.ljust(label) + "  ".join(
                cells[i].ljust(widths[i]) for i in group)).rstrip())


def _write_svg(paths: ProjectPaths, text: str) -> Path:
    """The comparison's SVG into the project (COMPARE_SVG, replaced by the next one); a read-only project's into a
    new file in the temp folder."""
    import tempfile

    target = paths.root / COMPARE_SVG
    try:
        atomic.write_text(target, text)
        return target
    except OSError:
        handle, name = tempfile.mkstemp(prefix="gguf-trainer-compare-", suffix=".svg")
        os.close(handle)
        atomic.write_text(Path(name), text)
        return Path(name)


def _compare(paths: ProjectPaths, view, refs: list[str], *, svg: str | None, as_json: bool) -> int:
    compared = compare_scores(view, refs)
    if as_json:
        if svg:
            atomic.write_text(Path(svg), compared.svg)
        print(json.dumps(compared.to_json(), indent=2))
        return 0
    if svg:
        atomic.write_text(Path(svg), compared.svg)
    svg = str(Path(svg) if svg else _write_svg(paths, compared.svg))
    # The runs by number: their names are 30 columns and more.
    for number, r in enumerate(compared.runs, 1):
        if r.snapshot is None:
            say(f"run {number}: {r.name}" + (f"  label: {r.label}" if r.label else ""))
        else:
            say(f"snapshot {number}: {r.name}, step {r.step} ({r.snapshot['weights']}) of run {r.snapshot['run']}")
    gguf_label = next(s.label for s in COMPARED if s.key == VAL_CENTRED_COSINE) + " of its GGUF"
    _print_compare_table(_compare_rows(compared.runs, gguf_label))
    for number, r in enumerate(compared.runs, 1):
        if r.snapshot is not None and not r.snapshot["evaluated"]:
            again = ["--best"] if r.snapshot["weights"] == "best" else ["--step", str(r.step)]
            say(f"snapshot {number} has no GGUF evaluation yet: `{trainer('snapshot', paths.root, *again, '--eval')}` "
                "scores it (or Evaluate in the studio's Snapshots list)")
    say(f"wrote the curves, one chart per score, to {svg}")
    return 0


def _numbered(run, number: int) -> str:
    """A compared run's column: ``run 1``, or ``snapshot 2``."""
    return f"{'run' if run.snapshot is None else 'snapshot'} {number}"
