"""Format versions of the stored results, in one place.

Each enters its stage's fingerprint (lib/corpus/corpus_run.py, lib/precompute/shards.py,
lib/training/training_run.py, lib/output/export_run.py, lib/output/report_run.py): bumping one
marks that stage, and what depends on it, stale in every project, so results written by older
code are recomputed instead of silently reused. Bump one when a change alters what its stage
writes. (The adapter GGUF's own `format_version` key is lib/output/gguf_format.FORMAT_VERSION.)
"""

CORPUS = 2  # 2: streaming readers (.csv, .gz) and a numpy split: the same seed orders prompts otherwise
SHARD_HALF = 1
TRAINING_RUN = 2
GGUF_EXPORT = 2
EVAL_REPORT = 3  # 3: keyed by the export's fingerprint alone (known before the export runs), not its sha256
