"""Riding out a cluster's broker or Postgres outage while following runs: the calls are tried again, then one line."""

from __future__ import annotations

import time
from collections.abc import Callable

from gguf_assets.orchestration.cluster import OUTAGE_S  # how long a cluster's Postgres or Redis may be away


class PipelineFailed(RuntimeError):
    """The pipeline cannot go on; the message is the user's (one line, or a few, and what to do)."""


def through_outages(call: Callable, echo: Callable[[str], None]):
    """``call()``, again every 2 s while the cluster's broker is away, for up to OUTAGE_S; then one clear line.

    A restart of Redis or Postgres lasts seconds: following the runs should outlive it, and the runs on the workers go
    on meanwhile. Postgres calls ride out a restart inside the storage itself (cluster_workers.py, in every
    process: this one, the workers' runs, the UI), so a lost Postgres connection that reaches here has lasted
    OUTAGE_S already: one line, at once."""
    # Only a cluster comes here: celery and dagster-postgres (cluster_workers.py) load then, not at every
    # `gguf-trainer run` (about 0.4 s of CPU before the first training step, #36).
    from gguf_assets.orchestration.cluster_workers import broker_errors, connection_lost, reason

    errors = broker_errors()
    began = None
    while True:
        try:
            answer = call()
        except errors as exc:
            first = first_line(exc)
            if began is None:
                began = time.monotonic()
                echo(f"lost the connection to the cluster's broker ({first}); trying again for up to "
                     f"{OUTAGE_S:.0f} s")
            elif time.monotonic() - began > OUTAGE_S:
                raise PipelineFailed(f"the cluster's broker has not answered for {OUTAGE_S:.0f} s ({first}). The "
                                     "runs on the workers go on; when Redis is back, `gguf-trainer run` "
                                     "continues.") from None
            time.sleep(2.0)
            continue
        except Exception as exc:
            if connection_lost(exc):
                raise PipelineFailed(f"the cluster's Postgres has not answered for {OUTAGE_S:.0f} s ({reason(exc)}). "
                                     "What the workers finished is kept; when Postgres is back, `gguf-trainer run` "
                                     "continues.") from None
            raise
        if began is not None:
            echo(f"connected again after {time.monotonic() - began:.0f} s")
        return answer


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
