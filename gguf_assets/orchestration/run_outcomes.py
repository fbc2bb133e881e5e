"""How runs ended: waiting for a set of runs to end, and one line for why a run failed."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import dagster as dg

from gguf_assets.orchestration.outages import through_outages
from gguf_assets.pipeline.resume import mark_interrupted_runs
from gguf_assets.pipeline.run_end import step_failure_line

POLL_S = 1.0
REPORT_EVERY_S = 10.0


_KILLED_BY = re.compile(r"was terminated by signal (\d+) \((\w+)\)")


def failure_message(instance, run_id: str) -> str:
    failed_step = step_failure_line(instance, run_id)
    if failed_step is not None:
        return failed_step
    # No step failed: the run's process died. Dagster's code server says how, in an engine event.
    for record in instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.ENGINE_EVENT}).records:
        found = _KILLED_BY.search(record.event_log_entry.dagster_event.message or "")
        if found:
            return f"its process was killed (signal {found.group(1)}, {found.group(2)})"
    return "the run failed"


def wait_for_runs(instance, run_ids: list[str], echo: Callable[[str], None], *, cluster: bool = False) -> None:
    """Until every run has ended. On a ``cluster`` a Postgres or Redis restart is ridden out (through_outages);
    the embedded SQLite's errors (a full disk, a damaged file) are the CLI's to report at once."""
    def poll():
        mark_interrupted_runs(instance)  # a worker killed -9 never ends its run: it is marked, so the wait ends
        return [instance.get_run_by_id(r) for r in run_ids]

    last_report = time.monotonic()
    while True:
        runs = through_outages(poll, echo) if cluster else poll()
        if all(r.is_finished for r in runs):
            return
        if time.monotonic() - last_report >= REPORT_EVERY_S:
            echo("waiting for " + ", ".join(f"run {r.run_id[:8]} ({r.status.value.lower()})"
                                            for r in runs if not r.is_finished))
            last_report = time.monotonic()
        time.sleep(POLL_S)
