"""Asset groups, numbered in pipeline order: the Dagster UI lists groups by name (catalog, lineage)."""

SETTINGS = "0_settings"
MATERIALS = "1_materials"
CORPUS = "2_corpus"
PRECOMPUTE = "3_precompute"
TRAINING = "4_training"
OUTPUT = "5_output"
IN_PIPELINE_ORDER = (SETTINGS, MATERIALS, CORPUS, PRECOMPUTE, TRAINING, OUTPUT)


def lineage_path() -> str:
    """The UI's global lineage with every group open (it collapses groups when there are several)."""
    return "/asset-groups?expanded=" + ",".join(f"global@global:{group}" for group in IN_PIPELINE_ORDER)
