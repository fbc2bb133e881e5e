"""Format versions of the stored results, and the prompt file formats, in one place.

Each enters its stage's fingerprint (lib/corpus/corpus_run.py, lib/precompute/shards_run.py,
lib/training/training_run.py, lib/output/export_run.py, lib/output/report_run.py): bumping one
marks that stage, and what depends on it, stale in every project, so results written by older
code are recomputed instead of silently reused. Bump one when a change alters what its stage
writes. (The adapter GGUF's own `format_version` key is lib/output/gguf_format.FORMAT_VERSION.)

The prompt file formats are what the corpus reads (lib/corpus/prompt_files.py, a reader for each) and what the
materials step downloads of a hub dataset (lib/materials/pinning/hub_files.py).
"""

CORPUS = 2  # 2: streaming readers (.csv, .gz) and a numpy split: the same seed orders prompts otherwise
SHARD_HALF = 2  # 2: the student reads ggk's LLaDA-Image template in ggk's pieces, final-norm states only
TRAINING_RUN = 3  # 3: the adapter is ggk's seedless resampler (lib/training/adapter.py)
GGUF_EXPORT = 3  # 3: ggk's adapter file (adapter.* tensors, the standardization folded into out_proj)

# Why a result of an older format is made again, for `status` (lib/status/states.py): the record's "format" (absent
# in records older than the key) against the current one.
WHY_NEWER = {
    "shard": (SHARD_HALF, "made before the student read what ggk feeds it (ggk's LLaDA-Image template, its token "
                          "ids, the final-norm states); computed again"),
    "adapter": (TRAINING_RUN, "trained as the product's own adapter, which ggk cannot load; it must be trained again "
                              "as ggk's resampler"),
}


def older_format(kind: str, record: dict) -> str | None:
    """Why ``record`` (a shard half's sidecar or the adapter manifest) is of an older format, or None."""
    current, why = WHY_NEWER[kind]
    recorded = record.get("format", 1)
    return f"{why} (format {recorded}, now {current})" if recorded != current else None
EVAL_REPORT = 5  # 5: prompt retrieval, which the verdict reads (4: ggk's adapter, centred on the rows' train mean)

# Prompt files: the text formats, each also read gzip-compressed (GZIP_SUFFIX after its suffix), and parquet
# (compressed inside the format).
TEXT_PROMPT_FORMATS = (".txt", ".jsonl", ".json", ".csv")
PARQUET = ".parquet"
GZIP_SUFFIX = ".gz"
PROMPT_FORMATS = (*TEXT_PROMPT_FORMATS, PARQUET)
PROMPT_FILE_SUFFIXES = (*PROMPT_FORMATS, *(f + GZIP_SUFFIX for f in TEXT_PROMPT_FORMATS))  # how their names end
