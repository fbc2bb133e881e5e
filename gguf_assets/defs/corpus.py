"""Corpus: cleaned, deduplicated text prompts split into train/val; registers the shard partitions."""


import dagster as dg

from gguf_assets.defs.materials import materials
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.core.markdown import markdown_table, user_text
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint, corpus_is_current, corpus_manifest
from gguf_assets.lib.corpus.prompt_files import check_prompt_files
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.project.manifests import CorpusManifest
from gguf_assets.pipeline import groups
from gguf_assets.pipeline.partitions import expected_shard_keys, sync_shard_partitions
from gguf_assets.pipeline.settings_observation import settings_key

_BAR_WIDTH = 30


def corpus_markdown(manifest: CorpusManifest) -> dict[str, str]:
    """The UI tables of a corpus manifest: preview, length histogram, sources, bad lines."""
    preview = markdown_table(["split", "source", "chars", "prompt"], (
        [row["split"], user_text(row["source"], 40), row["chars"],
         user_text(row["text"]) if row["text"] else "*(empty: the CFG prompt)*"]
        for row in manifest.preview), right=[2])
    bins = manifest.length_histogram
    peak = max((b["prompts"] for b in bins), default=0) or 1
    hist = markdown_table(["chars", "prompts", ""], (
        [f"{b['chars_from']}–{b['chars_to']}", b["prompts"], "█" * round(_BAR_WIDTH * b["prompts"] / peak)]
        for b in bins), right=[1])
    sources = markdown_table(["source", "file", "read", "blank", "length", "duplicate", "bad", "kept"], (
        [user_text(st["source"], 60), user_text(st["file"].rsplit("/", 1)[-1], 60), st["read"], st["dropped_blank"],
         st["dropped_length"], st["dropped_duplicate"], st["skipped_bad_lines"], st["kept"]]
        for st in manifest.sources), right=range(2, 8))
    tables = {"preview": preview, "length_histogram": hist, "sources": sources}
    if manifest.bad_line_samples:
        tables["bad_lines"] = "\n".join(f"- `{m.replace('`', chr(39))}`" for m in manifest.bad_line_samples)
    return tables


@dg.asset(group_name=groups.CORPUS, deps=[materials, settings_key("corpus")],
          description="Text prompts (about 1% empty for the CFG prompt), "
          "deduplicated, length-filtered and split train/val with no overlap; deterministic for the seed.")
def corpus(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    check_prompt_files(paths, settings)  # a typo in a local file fails here, not after hours of work
    manifest_in = load_manifest(paths)
    reused = corpus_is_current(paths, settings, manifest_in)
    if reused:
        manifest = corpus_manifest(paths)
        context.log.info("corpus is current for these settings; reusing it")
    else:
        manifest = build_corpus(paths, settings, manifest_in,
                                fingerprint=corpus_fingerprint(paths, settings, manifest_in))
    wanted = expected_shard_keys(manifest, settings)
    sync_shard_partitions(context.instance, wanted)
    project.result_written(context)
    # The data version is the content's fingerprint: a reused corpus leaves the shards current in the UI.
    return dg.MaterializeResult(data_version=dg.DataVersion(manifest.fingerprint), metadata={
        **project.stage_metadata("corpus", settings), "reused": reused, **corpus_metadata(manifest),
        "train_shards": len(wanted["train"]), "val_shards": len(wanted["val"]),
        "manifest": dg.MetadataValue.path(str(paths.corpus_manifest)),
    })


def corpus_metadata(manifest: CorpusManifest) -> dict:
    """A corpus manifest's figures and tables, as the corpus asset's metadata."""
    return {
        "fingerprint": manifest.fingerprint,
        "train_prompts": manifest.prompts("train"), "val_prompts": manifest.prompts("val"),
        "train_prompts_requested": manifest.asked()["train"],
        "empty_train": manifest.splits["train"]["empty"], "empty_val": manifest.splits["val"]["empty"],
        **{f"count_{k}": v for k, v in manifest.counts.items()},
        **{f"length_{k}": v for k, v in manifest.length_chars.items()},
        "sources_files": len(manifest.sources),
        **{name: dg.MetadataValue.md(md) for name, md in corpus_markdown(manifest).items()},
    }
