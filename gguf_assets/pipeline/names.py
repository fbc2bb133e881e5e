"""The names the definitions (defs/) and the drivers (orchestration/, the CLI, the studio) share: the named jobs,
the run config that gives a job its console, the GPU pool and the cluster's Celery queues. Names only: the
definitions made of them are in defs/."""

# The pipeline is these four jobs, in this order (defs/jobs.py defines them).
MATERIALS_AND_CORPUS = "materials_and_corpus"
SHARDS_JOB = {"train": "precompute_train_shards", "val": "precompute_val_shards"}
TRAIN_AND_EXPORT = "train_export_evaluate"
# Dagster uses a job's own loggers only when the run config names them (defs/console.py).
CONSOLE = {"loggers": {"console": {}}}
# The concurrency pool of the steps that hold a GPU (sized to the machine's GPUs by the instance).
GPU_POOL = "gpu"
# The Celery queues of a cluster's workers: precompute and training on `gpu`, materials and corpus on `cpu`.
# Each job names its queue in this tag (dagster_celery.tags.DAGSTER_CELERY_QUEUE_TAG: dagster-celery is an
# optional install, and the jobs are defined without it).
GPU_QUEUE = "gpu"
CPU_QUEUE = "cpu"
QUEUES = (GPU_QUEUE, CPU_QUEUE)
QUEUE_TAG = "dagster-celery/queue"
