"""The console logger of every job: one short line per message, no colours, no stack traces.

Dagster's default console logger prefixes each line with about 120 characters (time, job, run
id, step) and prints whole stack traces. The full event log, stack traces included, stays in
the run's page in the UI; the console gets the time, the step and the message, and for a
failed step its error message only.
"""

import logging
import sys
import time

import dagster as dg

from gguf_assets.pipeline.messages import user_message
from gguf_assets.pipeline.private_api import LOG_RECORD_METADATA_ATTR


class ShortFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, LOG_RECORD_METADATA_ATTR, None) or {}
        event = meta.get("dagster_event")
        message = meta.get("orig_message", record.getMessage())
        if event is not None:
            error = getattr(event.event_specific_data, "error", None)
            # Only a failed step is worth a console line; the run's failure repeats it.
            if error is None or not event.is_step_failure:
                return ""
            message = f"failed: {user_message(error)}"
        step = meta.get("step_key") or meta.get("job_name") or ""
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"{stamp} {step:<14} {message}"


class _SkipEmpty(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        if self.format(record):
            super().emit(record)


@dg.logger(description="Short console lines (time, step, message); the full log is in the run's page in the UI.")
def short_console(init_context: dg.InitLoggerContext) -> logging.Logger:
    logger = logging.Logger("gguf_assets.console", level=logging.INFO)
    handler = _SkipEmpty(sys.stderr)
    handler.setFormatter(ShortFormatter())
    logger.addHandler(handler)
    return logger
