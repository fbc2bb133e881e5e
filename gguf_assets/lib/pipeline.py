"""What is done and what is not: the fingerprints that chain the stages, and the project status.

Each stage's output records the fingerprint of everything it was made from. A stage is
current when its recorded fingerprint equals the one computed from the current settings
and upstream outputs; otherwise it is missing or stale and is recomputed, never reused.
`gguf-trainer run` and `--auto-resume` use this to launch only the work that is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib import atomic
from gguf_assets.lib.layout import SPLITS, ProjectPaths
from gguf_assets.lib.materials import manifest_is_current, pins
from gguf_assets.lib.settings import Settings

STAGES = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")
GGUF_SUFFIX = ".gguf"


def corpus_fingerprint(paths: ProjectPaths, settings: Settings, materials: dict) -> str:
    local = []
    for value in settings.corpus.local_prompt_files:
        file = paths.resolve_local(value)
        local.append([value, atomic.sha256_file(file) if file.is_file() else None])
    datasets = [[d["source"], d["commit"], d.get("text_field")] for d in materials.get("datasets", [])]
    # format 2: streaming readers (.csv, .gz), numpy split; the same seed orders prompts differently than format 1.
    return atomic.fingerprint({"corpus": settings.section_dict("corpus"), "datasets": datasets, "local": local,
                               "format": 2})


def corpus_is_current(paths: ProjectPaths, settings: Settings, materials: dict) -> bool:
    if not paths.corpus_manifest.is_file():
        return False
    manifest = atomic.read_json(paths.corpus_manifest)
    if manifest.get("fingerprint") != corpus_fingerprint(paths, settings, materials):
        return False
    return all(paths.corpus_file(s).is_file() and atomic.sha256_file(paths.corpus_file(s)) == manifest["splits"][s]["sha256"]
               for s in SPLITS)


def shard_fingerprints(paths: ProjectPaths, settings: Settings, materials: dict, split: str) -> list[str]:
    from gguf_assets.lib.shards import halves_for_mode, plan_shards

    halves = halves_for_mode(settings.precompute.mode)
    return [":".join(plan.fingerprints[h] for h in halves) for plan in plan_shards(paths, settings, materials, split)]


def adapter_fingerprint(paths: ProjectPaths, settings: Settings, materials: dict) -> str:
    from gguf_assets.lib.train import training_fingerprint

    return training_fingerprint(settings, shard_fingerprints(paths, settings, materials, "train"),
                                shard_fingerprints(paths, settings, materials, "val"))


def gguf_path(paths: ProjectPaths, settings: Settings) -> Path:
    return paths.output_dir(settings) / f"{settings.output.adapter_name}{GGUF_SUFFIX}"


def gguf_fingerprint(settings: Settings, materials: dict, adapter_fp: str) -> str:
    # also_copy_to is here because the copy is part of the export: a new folder must get one.
    return atomic.fingerprint({"adapter": adapter_fp, "name": settings.output.adapter_name,
                               "student": pins(materials, "student"), "teacher": pins(materials, "teacher"),
                               "template": settings.precompute.prompt_template,
                               "vision": [pins(materials, "vision_encoder"), settings.output.export_vision_encoder],
                               "also_copy_to": settings.output.also_copy_to, "format": 2})


def report_fingerprint(settings: Settings, gguf_sidecar: dict, val_fps: list[str]) -> str:
    # The report lists the exported files, so the settings that change that list count too.
    # The sidecar's own fingerprint covers what the export was made from (vision source included).
    return atomic.fingerprint({"gguf": [gguf_sidecar["sha256"], gguf_sidecar["fingerprint"]], "val": val_fps,
                               "evaluate": settings.output.evaluate,
                               "ggk_command": settings.output.ggk_command,
                               "vision": settings.output.export_vision_encoder,
                               "also_copy_to": settings.output.also_copy_to, "format": 2})


def settings_code_versions(settings: Settings) -> dict[str, str]:
    """Per asset, a hash of every setting its result depends on, given to Dagster as its code version.

    Each version includes the versions of the assets it reads, so a settings change shows in
    the Dagster UI at once as exactly the assets the next run recomputes: a teacher change
    marks the shards and everything after them, never the corpus. The slices mirror what
    each stage's fingerprint uses; cadence settings (log_every, ...) are in none of them.
    """
    from gguf_assets.lib.materials import materials_settings_key
    from gguf_assets.lib.train import NON_RESULT_KEYS

    m, p, o = settings.materials, settings.precompute, settings.output
    student = [m.student, m.student_layer, p.student_dtype]
    teacher = None if p.mode == "student" else {
        "source": ["mock", *student] if p.mock_teacher else [m.teacher, m.query_rows_file, m.query_rows_tensor,
                                                              m.teacher_layer],
        "dtype": p.target_dtype}
    corpus = atomic.fingerprint({"datasets": m.datasets, **settings.section_dict("corpus")})
    halves = {"corpus": corpus, "teacher": teacher, "student": None if p.mode == "teacher" else student,
              "template": p.prompt_template}
    train_shards = atomic.fingerprint({**halves, "shard_size": p.shard_size})
    val_shards = atomic.fingerprint({**halves, "shard_size": p.val_shard_size})
    adapter = atomic.fingerprint({"train": train_shards, "val": val_shards, **{
        k: v for k, v in settings.section_dict("training").items() if k not in NON_RESULT_KEYS}})
    gguf = atomic.fingerprint({"adapter": adapter, "name": o.adapter_name, "dir": o.output_dir,
                               "copy": o.also_copy_to, "vision": [m.vision_encoder, o.export_vision_encoder]})
    eval_report = atomic.fingerprint({"gguf": gguf, "evaluate": o.evaluate, "ggk_command": o.ggk_command})
    return {"materials": atomic.fingerprint(materials_settings_key(settings)), "corpus": corpus,
            "train_shards": train_shards, "val_shards": val_shards, "adapter": adapter, "gguf": gguf,
            "eval_report": eval_report}


def recorded_fingerprint(sidecar: Path) -> str | None:
    try:
        return atomic.read_json(sidecar).get("fingerprint")
    except (OSError, ValueError):
        return None


def _exported_files_present(sidecar: Path) -> bool:
    """Every file the export wrote (GGUF, vision GGUF, copies) is still there at its size."""
    try:
        entry = atomic.read_json(sidecar)
    except (OSError, ValueError):
        return False
    files = entry.get("files") or [{"path": entry.get("path", ""), "bytes": entry.get("bytes")}]
    return all(Path(f["path"]).is_file() and Path(f["path"]).stat().st_size == f["bytes"] for f in files)


@dataclass(frozen=True)
class StageState:
    stage: str
    state: str  # current | missing | stale | blocked
    detail: str = ""


def project_status(paths: ProjectPaths, settings: Settings) -> list[StageState]:
    """The state of every stage, in pipeline order. Later stages are 'blocked' behind unfinished ones."""
    from gguf_assets.lib.shards import plan_shards, shard_status

    out: list[StageState] = []

    def blocked_rest(after: str) -> list[StageState]:
        return [StageState(s, "blocked", f"waits for {after}") for s in STAGES[STAGES.index(after) + 1:]]

    if not manifest_is_current(paths, settings):
        state = "stale" if paths.materials_manifest.is_file() else "missing"
        return [StageState("materials", state)] + blocked_rest("materials")
    out.append(StageState("materials", "current"))
    materials = atomic.read_json(paths.materials_manifest)
    if not corpus_is_current(paths, settings, materials):
        state = "stale" if paths.corpus_manifest.is_file() else "missing"
        return out + [StageState("corpus", state)] + blocked_rest("corpus")
    out.append(StageState("corpus", "current"))
    unfinished = False
    for split in SPLITS:
        plans = plan_shards(paths, settings, materials, split)
        todo = [p.key for p in plans if set(shard_status(paths, settings, p).values()) != {"current"}]
        state = "current" if not todo else ("missing" if len(todo) == len(plans) else "stale")
        out.append(StageState(f"{split}_shards", state, f"{len(plans) - len(todo)}/{len(plans)} shards current"))
        unfinished |= bool(todo)
    if unfinished:
        return out + blocked_rest("val_shards")
    if settings.precompute.mode != "teacher+student":
        return out + [StageState(s, "blocked", f"precompute.mode is {settings.precompute.mode!r}; training needs "
                                 "teacher+student") for s in STAGES[STAGES.index("adapter"):]]
    adapter_fp = adapter_fingerprint(paths, settings, materials)
    if recorded_fingerprint(paths.adapter_manifest) != adapter_fp:
        return out + [StageState("adapter", "stale" if paths.adapter_manifest.is_file() else "missing")] + blocked_rest("adapter")
    out.append(StageState("adapter", "current"))
    gguf = gguf_path(paths, settings)
    sidecar = gguf.with_suffix(".json")
    if recorded_fingerprint(sidecar) != gguf_fingerprint(settings, materials, adapter_fp) or not _exported_files_present(sidecar):
        return out + [StageState("gguf", "stale" if sidecar.is_file() else "missing")] + blocked_rest("gguf")
    out.append(StageState("gguf", "current"))
    from gguf_assets.lib.layout import REPORT_JSON

    report = paths.output_dir(settings) / REPORT_JSON
    expected = report_fingerprint(settings, atomic.read_json(sidecar),
                                  shard_fingerprints(paths, settings, materials, "val"))
    out.append(StageState("eval_report", "current" if recorded_fingerprint(report) == expected else
                          ("stale" if report.is_file() else "missing")))
    return out
