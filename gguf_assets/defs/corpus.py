"""Corpus: cleaned, deduplicated text prompts split into train/val; registers the shard partitions."""


import dagster as dg

from gguf_assets.defs.materials import materials
from gguf_assets.defs.partitions import BY_SPLIT
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib import atomic
from gguf_assets.lib.corpus import build_corpus, read_split
from gguf_assets.lib.layout import SPLITS, shard_key
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.pipeline import corpus_fingerprint, corpus_is_current


def sync_shard_partitions(instance: dg.DagsterInstance, counts: dict[str, int]) -> None:
    """Make each split's dynamic partitions exactly shard 0..n-1 (insertion order = index order)."""
    for split, n in counts.items():
        name = BY_SPLIT[split].name
        wanted = [shard_key(i) for i in range(n)]
        existing = list(instance.get_dynamic_partitions(name))
        if existing[: len(wanted)] != wanted[: len(existing)]:
            for key in existing:  # order broken (should not happen): rebuild so ranges stay contiguous
                instance.delete_dynamic_partition(name, key)
            existing = []
        for key in existing[len(wanted):]:
            instance.delete_dynamic_partition(name, key)
        missing = wanted[len(existing):]
        if missing:
            instance.add_dynamic_partitions(name, missing)


def shard_counts(prompts: dict[str, int], *, shard_size: int, val_shard_size: int) -> dict[str, int]:
    sizes = {"train": shard_size, "val": val_shard_size}
    return {split: -(-prompts[split] // sizes[split]) for split in SPLITS}


@dg.asset(group_name="corpus", deps=[materials], description="Text prompts (about 1% empty for the CFG prompt), "
          "deduplicated, length-filtered and split train/val with no overlap; deterministic for the seed.")
def corpus(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    manifest_in = load_manifest(paths)
    reused = corpus_is_current(paths, settings, manifest_in)
    if reused:
        manifest = atomic.read_json(paths.corpus_manifest)
        context.log.info("corpus is current for these settings; reusing it")
    else:
        manifest = build_corpus(paths, settings, manifest_in, fingerprint=corpus_fingerprint(paths, settings, manifest_in))
    prompts = {s: manifest["splits"][s]["prompts"] for s in SPLITS}
    p = settings.precompute
    counts = shard_counts(prompts, shard_size=p.shard_size, val_shard_size=p.val_shard_size)
    sync_shard_partitions(context.instance, counts)
    preview = [t for t in read_split(paths, "val")[:12]]
    table = ["| # | prompt |", "|---|---|"] + [f"| {i} | {t[:160].replace('|', '/') or '(empty: CFG prompt)'} |"
                                                for i, t in enumerate(preview)]
    hist = ["| chars | prompts |", "|---|---|"] + [f"| {k}+ | {v} |" for k, v in manifest["length_histogram_50chars"].items()]
    sources = ["| source | kept |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in manifest["per_source"].items()]
    return dg.MaterializeResult(metadata={
        "reused": reused, "fingerprint": manifest["fingerprint"],
        "train_prompts": prompts["train"], "val_prompts": prompts["val"],
        "empty_train": manifest["splits"]["train"]["empty"], "empty_val": manifest["splits"]["val"]["empty"],
        **{f"count_{k}": v for k, v in manifest["counts"].items()},
        "train_shards": counts["train"], "val_shards": counts["val"],
        "preview": dg.MetadataValue.md("\n".join(table)),
        "length_histogram": dg.MetadataValue.md("\n".join(hist)),
        "sources": dg.MetadataValue.md("\n".join(sources)),
    })
