"""Every run tag gguf_assets sets or reads, in one place.

Bookkeeping tags (which process runs a run, which settings snapshot a pipeline runs under) sit
under Dagster's hidden prefix, so the UI's runs list and run pages do not show them; the tags a
user reads (worker, interrupted, stopped) stay visible. ``get`` also reads the names earlier
versions wrote, so the runs of an existing project are still recognised.
"""

from collections.abc import Mapping

# Dagster's own: the shard range of a single-run backfill.
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"

_HIDDEN = ".dagster/gguf_assets/"  # Dagster's hidden prefix (private_api.HIDDEN_TAG_PREFIX), then ours
_VISIBLE = "gguf_assets/"

# The process executing a run, so a run cut off by a kill -9 or a reboot is recognised (resume.py).
# Every job runs in-process, so that process is the run's for its life.
PID_TAG = f"{_HIDDEN}pid"
PID_STARTED_TAG = f"{_HIDDEN}pid_started"
BOOT_TAG = f"{_HIDDEN}boot_id"
# Which machine executes a run (a hash of its machine id, never a host name): a pid means something
# only there; a run on another machine is judged by the run launcher's health check instead.
MACHINE_TAG = f"{_HIDDEN}machine"
# On the worker runs of `gguf-trainer run --workers N`: the pid of the pipeline that launched them.
LEADER_TAG = f"{_HIDDEN}leader_pid"
# On runs a cluster pipeline launched to Celery workers: they join the pipeline that admitted them (lock.py).
ADMITTED_TAG = f"{_HIDDEN}admitted"
# The hash of the settings snapshot a run executed under (lib/project/settings_history.py).
SETTINGS_TAG = f"{_HIDDEN}settings"
# On the runs of a pipeline (`gguf-trainer run`, the resume sensor): "finish the pipeline under this
# settings snapshot" (its hash); every job of it loads that snapshot, and the resume sensor continues it.
PIPELINE_TAG = f"{_HIDDEN}pipeline"

# Shown: which worker of `run --workers N` a run is ("1/2").
WORKER_TAG = f"{_VISIBLE}worker"
# Shown: the GPU a worker run is pinned to (its CUDA_VISIBLE_DEVICES entry); the shard step pins its process to it.
GPU_TAG = f"{_VISIBLE}gpu"
# A run that died with its process (kill -9, OOM, reboot): the resume sensor finishes its work.
INTERRUPTED_TAG = f"{_VISIBLE}interrupted"
# A run stopped on purpose (Ctrl-C, SIGTERM, Terminate): resumable, but only when the user asks.
STOPPED_TAG = f"{_VISIBLE}stopped"

HIDDEN_TAGS = (PID_TAG, PID_STARTED_TAG, BOOT_TAG, MACHINE_TAG, LEADER_TAG, ADMITTED_TAG, SETTINGS_TAG,
               PIPELINE_TAG)
# The names of the hidden tags before they were hidden.
_EARLIER = {tag: f"{_VISIBLE}{tag.removeprefix(_HIDDEN)}" for tag in HIDDEN_TAGS}


def get(tags: Mapping[str, str], tag: str) -> str | None:
    """A tag's value on a run, under its current name or the one an earlier version wrote."""
    value = tags.get(tag)
    return value if value is not None else tags.get(_EARLIER.get(tag, tag))
