"""GPU check: one command that exercises the CUDA paths of the pipeline and prints their figures.

    .venv/bin/python benchmarks/gpu_check.py          # on a GPU machine (about 5-8 min on one large GPU)
    .venv/bin/python benchmarks/gpu_check.py --tiny   # anywhere (the tests run it on CPU in about a minute)

It builds its own random-weight materials in a temp folder (the demo's tokenizer and prompts;
on a GPU a Qwen3-MoE teacher of about 4 GiB in bf16 and a 1024-wide Qwen3 student) and runs
the library's own stages on them, without Dagster:

1. environment: torch, the device, its memory;
2. precompute under `sequential` and under `balanced` placement, each with an explicit GPU
   budget: teacher prompts/s and tokens/s, where the layers went; bf16 on the GPU;
3. out of memory (CUDA only): this process's GPU memory is capped below the teacher, and the
   first budget is above it; the precompute must lower the budget by itself and finish;
4. training at a real adapter size (1024 x 6 on a GPU) for a few hundred steps: steps/s,
   peak GPU memory, a finite loss;
5. export and the numpy evaluation of the GGUF, which must agree with torch within 1e-3;
6. every GPU (needs 2 or more; "skipped: N GPU(s)" otherwise): `gguf-trainer run DIR --workers auto` as a user
   runs it, one shard worker per GPU: each shard must record a GPU of its own worker, all GPUs must have
   computed shards, and the shards must be byte-identical to one worker's on one GPU.

Each check prints PASS, FAIL or SKIP (with why) and its figures; the exit code is 1 if any
check failed. The seed's figures for comparison: teacher about 4.5 prompts/s sequential vs
2.4 balanced (30 GB MoE, RTX 5090 + 4050), 20k training steps at 1024 x 6 in about 55 min.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
from gguf_assets.lib.demo.demo import QUERY_ROWS_FILENAME, QUERY_ROWS_TENSOR, build_demo_materials, demo_settings
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.precompute.shards import precompute_split
from gguf_assets.lib.precompute.shards_run import plan_shards, require_current
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, replace, write_project_file

GIB = 1 << 30
AGREEMENT = 1e-3  # the numpy GGUF reader vs the torch checkpoint (the eval_report check's bound)


@dataclass(frozen=True)
class Size:
    """How big everything is: real widths on a GPU, a tiny run elsewhere."""

    prompts: int
    val_prompts: int
    shard_size: int
    teacher: dict | None   # Qwen3-MoE config overrides for a bigger teacher; None: the demo's own
    student: dict | None
    width: int
    depth: int
    heads: int
    steps: int
    batch_size: int


GPU_SIZE = Size(prompts=384, val_prompts=64, shard_size=128,
                teacher={"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
                         "num_key_value_heads": 4, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4,
                         "moe_intermediate_size": 768, "intermediate_size": 6144},
                student={"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                         "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 3072},
                width=1024, depth=6, heads=16, steps=300, batch_size=32)
TINY_SIZE = Size(prompts=48, val_prompts=16, shard_size=24, teacher=None, student=None,
                 width=64, depth=1, heads=4, steps=20, batch_size=8)


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    figures: str


def _bigger_models(materials: Path, size: Size, device: torch.device) -> None:
    """Replace the demo teacher and student with random models of real widths (built on the GPU: fast)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    for role, overrides in (("teacher", size.teacher), ("student", size.student)):
        folder = materials / role
        config = AutoConfig.from_pretrained(folder)
        for key, value in (overrides or {}).items():
            setattr(config, key, value)
        config.initializer_range = 0.02
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        for weights in folder.glob("model*.safetensors"):
            weights.unlink()
        model.save_pretrained(folder, safe_serialization=True)
        del model
        if role == "teacher":
            gen = torch.Generator().manual_seed(0)
            rows = torch.randn(256, config.hidden_size, generator=gen) * 0.02
            save_file({QUERY_ROWS_TENSOR: rows.contiguous()}, str(folder / QUERY_ROWS_FILENAME),
                      metadata={"format": "pt"})
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _teacher_gib(paths: ProjectPaths, settings: Settings) -> float:
    folder = paths.resolve_local(settings.materials.teacher)
    return sum(f.stat().st_size for f in folder.glob("model*.safetensors")) / GIB


def _precompute(paths: ProjectPaths, settings: Settings, materials: dict) -> dict:
    """Both splits from scratch (placement changes no result, so old shards would be reused)."""
    shutil.rmtree(paths.root / "shards", ignore_errors=True)
    summary: dict = {}
    for split in ("train", "val"):
        keys = [p.key for p in plan_shards(paths, settings, materials, split)]
        run = precompute_split(paths, settings, materials, split, keys)
        if split == "train":
            summary = run.metadata()
    require_current(paths, settings, materials, "train")
    return summary


def _placement_figures(summary: dict) -> str:
    where = ", ".join(f"{k[len('teacher_'):-len('_gib')]} {v:.2f} GiB" for k, v in summary.items()
                      if k.startswith("teacher_") and k.endswith("_gib") and k != "teacher_gpu_budget_gib")
    return (f"teacher {summary['teacher_prompts_per_s']:.2f} prompts/s, {summary['teacher_tokens_per_s']:.0f} "
            f"tokens/s; student {summary['student_prompts_per_s']:.2f} prompts/s; layers: {where or 'n/a'}")


def check_precompute(paths, settings, materials, device, results) -> None:
    targets_dtype_ok = True
    for placement in ("sequential", "balanced"):
        if placement == "balanced" and device.type != "cuda":
            results.append(Result("precompute balanced", "SKIP", "needs CUDA (on CPU the teacher is on one device)"))
            continue
        budget = {} if device.type != "cuda" else {
            "teacher_gpu_memory_gib": round(torch.cuda.mem_get_info(device.index or 0)[0] * 0.8 / GIB, 1)}
        chosen = replace(settings, precompute={"teacher_placement": placement, **budget})
        began = time.perf_counter()
        summary = _precompute(paths, chosen, materials)
        shard = plan_shards(paths, chosen, materials, "train")[0].folder(paths)
        from gguf_assets.lib.training.train_data import read_half

        targets = read_half(shard, "teacher")["targets"]
        hidden = read_half(shard, "student")["hidden"]
        finite = bool(torch.isfinite(targets.float()).all()) and bool(torch.isfinite(hidden.float()).all())
        targets_dtype_ok &= hidden.dtype == torch.bfloat16
        results.append(Result(f"precompute {placement}", "PASS" if finite else "FAIL",
                              f"{_placement_figures(summary)}; {time.perf_counter() - began:.1f} s; student states "
                              f"{hidden.dtype}, targets {targets.dtype}{'' if finite else ', NOT FINITE'}"))
    results.append(Result("bf16 student states", "PASS" if targets_dtype_ok else "FAIL",
                          f"precompute.student_dtype bf16; the teacher runs in "
                          f"{'bf16' if device.type == 'cuda' else 'f32 (CPU)'}"))


def check_oom_lowering(paths, settings, materials, device, results, caplog_records) -> None:
    if device.type != "cuda":
        results.append(Result("out-of-memory auto-lower", "SKIP", "needs CUDA"))
        return
    from gguf_assets.lib.precompute.teacher import OOM_STEP_GIB

    teacher = _teacher_gib(paths, settings)
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    cap = teacher * 0.5 + 0.5            # the whole teacher cannot fit; half of it can, with room to run
    start = teacher + 1.0                # so the first try puts it all on the GPU and runs out of memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        chosen = replace(settings, precompute={"teacher_placement": "sequential", "teacher_gpu_memory_gib": start})
        summary = _precompute(paths, chosen, materials)
        lowered = [r for r in caplog_records if "retrying with" in r.getMessage()]
        used = summary.get("teacher_gpu_budget_gib")
        ok = bool(lowered) and used is not None and used <= start - OOM_STEP_GIB
        results.append(Result("out-of-memory auto-lower", "PASS" if ok else "FAIL",
                              f"teacher {teacher:.2f} GiB, GPU capped at {cap:.2f} GiB, budget {start:.1f} -> "
                              f"{used} GiB after {len(lowered)} automatic retries; {_placement_figures(summary)}"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def check_training_and_export(paths, settings, materials, device, results) -> None:
    from gguf_assets.lib.output.export import export_adapter
    from gguf_assets.lib.output.gguf_eval import evaluate_gguf, training_centre
    from gguf_assets.lib.training.events import LogStep, TrainingEvent
    from gguf_assets.lib.training.train import train_adapter
    from gguf_assets.lib.training.training_run import adapter_fingerprint, final_weights

    folders = {split: require_current(paths, settings, materials, split) for split in ("train", "val")}
    fingerprint = adapter_fingerprint(paths, settings, materials)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps_timing: list[float] = []

    def on_event(event: TrainingEvent) -> None:
        if isinstance(event, LogStep):
            steps_timing.append(event.steps_per_s)

    began = time.perf_counter()
    summary = train_adapter(paths, settings, train_folders=folders["train"], val_folders=folders["val"],
                            fingerprint=fingerprint, on_event=on_event)
    seconds = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    t = settings.training
    losses = [e["loss"] for e in summary.history if "loss" in e]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    rate = steps_timing[-1] if steps_timing else t.steps / seconds
    results.append(Result(f"training {t.width} x {t.depth}", "PASS" if finite and summary.finished else "FAIL",
                          f"{t.steps} steps in {seconds:.1f} s ({rate:.2f} steps/s at the end, batch "
                          f"{t.batch_size}); peak GPU memory {peak:.2f} GiB; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                          f"val centred cosine {summary.val_centred_cosine:.4f}; 20k steps would take about "
                          f"{20000 / rate / 60:.0f} min"))

    run_dir = paths.checkpoints_dir(fingerprint)
    atomic.write_json(paths.adapter_manifest, {"fingerprint": fingerprint,
                                               "run_dir": str(run_dir.relative_to(paths.root))})
    began = time.perf_counter()
    sidecar = export_adapter(paths, settings, materials, atomic.read_json(paths.adapter_manifest))
    export_s = time.perf_counter() - began
    evaluation = evaluate_gguf(Path(sidecar.path), folders["val"], training_centre(final_weights(paths)))
    difference = abs(evaluation["val_centred_cosine"] - sidecar.val_centred_cosine_torch)
    results.append(Result("GGUF agrees with torch", "PASS" if difference < AGREEMENT else "FAIL",
                          f"{sidecar.bytes / 2**20:.1f} MiB exported in {export_s:.2f} s; numpy "
                          f"{evaluation['val_centred_cosine']:.6f} vs torch {sidecar.val_centred_cosine_torch:.6f} "
                          f"(difference {difference:.1e}, bound {AGREEMENT})"))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_every_gpu(paths: ProjectPaths, settings: Settings, materials: dict, results: list[Result]) -> None:
    """`run --workers auto` on every visible GPU, then the same shards by one worker on one GPU: the same bytes."""
    import json
    import os
    import subprocess

    from gguf_assets.lib.telemetry.hardware import visible_gpus

    gpus = visible_gpus() if torch.cuda.is_available() else []
    if len(gpus) < 2:
        results.append(Result("every GPU (--workers auto)", "SKIP", f"skipped: {len(gpus)} GPU(s)"))
        return
    shutil.rmtree(paths.root / "shards", ignore_errors=True)
    chosen = replace(settings, precompute={"device": "auto", "teacher_placement": "sequential"})
    write_project_file(paths.root, chosen)
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT")}
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "gguf_assets.cli", "run", str(paths.root), "--workers", "auto"],
                         env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - began
    if run.returncode != 0:
        results.append(Result("every GPU (--workers auto)", "FAIL", (run.stdout + run.stderr)[-2000:]))
        return
    plans = plan_shards(paths, chosen, materials, "train")
    devices = {p.key: json.loads((p.folder(paths) / "teacher.json").read_text())["device"] for p in plans}
    parallel = {p.key: (p.folder(paths) / "teacher.safetensors").read_bytes() for p in plans}
    shutil.rmtree(paths.root / "shards")
    one = replace(chosen, precompute={"device": "cuda:0"})
    precompute_split(paths, one, materials, "train", [p.key for p in plans])
    same = all((p.folder(paths) / "teacher.safetensors").read_bytes() == parallel[p.key] for p in plans)
    used = sorted(set(devices.values()))
    ok = same and len(used) == min(len(gpus), len(plans))
    results.append(Result("every GPU (--workers auto)", "PASS" if ok else "FAIL",
                          f"{len(gpus)} GPUs, {len(plans)} train shards computed on {', '.join(used)}; whole run "
                          f"{seconds:.0f} s; shards byte-identical to one worker's on one GPU: {same}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU, about a minute)")
    parser.add_argument("--keep", type=Path, help="build the temp project here and keep it")
    args = parser.parse_args(argv)
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    records = _Records()
    logging.getLogger("gguf_assets").addHandler(records)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    size = TINY_SIZE if args.tiny or not cuda else GPU_SIZE
    env = f"torch {torch.__version__}, {device}"
    if cuda:
        props = torch.cuda.get_device_properties(device)
        env += f" ({props.name}, {props.total_memory / GIB:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()})"
    print(f"gpu_check: {env}; size {'tiny' if size is TINY_SIZE else 'real widths'}", flush=True)

    results: list[Result] = []
    root = args.keep or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    began = time.perf_counter()
    try:
        materials_root = root / "materials" / "demo"
        build_demo_materials(materials_root, seed=0, n_prompts=max(2000, size.prompts + size.val_prompts + 100))
        if size.teacher is not None:
            _bigger_models(materials_root, size, device)
        settings = replace(
            demo_settings(steps=size.steps),
            corpus={"train_prompts": size.prompts, "val_prompts": size.val_prompts},
            precompute={"device": str(device), "shard_size": size.shard_size, "val_shard_size": size.val_prompts,
                        "student_dtype": "bf16", "teacher_batch": 16, "token_budget": 16 * 320},
            training={"device": str(device), "width": size.width, "depth": size.depth, "heads": size.heads,
                      "steps": size.steps, "batch_size": size.batch_size, "learning_rate": 2e-4,
                      "warmup_steps": max(1, size.steps // 10), "log_every": max(1, size.steps // 10),
                      "validate_every": size.steps, "checkpoint_every": size.steps})
        write_project_file(root, settings)
        paths = ProjectPaths.of(root)
        materials = resolve_materials(paths, settings)
        build_corpus(paths, settings, materials, fingerprint=corpus_fingerprint(paths, settings, materials))
        results.append(Result("environment", "PASS", env))
        checks = {"precompute": lambda: check_precompute(paths, settings, materials, device, results),
                  "out-of-memory auto-lower": lambda: check_oom_lowering(paths, settings, materials, device, results,
                                                                         records.records),
                  "training and export": lambda: check_training_and_export(paths, settings, materials, device,
                                                                           results),
                  "every GPU": lambda: check_every_gpu(paths, settings, materials, results)}
        for name, check in checks.items():
            try:
                check()
            except Exception as exc:  # report it and go on: the other checks still say something
                results.append(Result(name, "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    for r in results:
        print(f"{r.status:<4}  {r.name:<26} {r.figures}")
    failed = [r for r in results if r.status == "FAIL"]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed or skipped, {len(failed)} failed; "
          f"{time.perf_counter() - began:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
