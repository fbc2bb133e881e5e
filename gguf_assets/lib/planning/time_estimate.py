"""How long a project's precompute and training take, each line saying where its figure comes from:

- measured on this machine: the work in progress (lib/status/pace.py), else what this project already did here
  (its shard halves' sidecars; its training runs' steps and seconds, scaled to the settings' adapter);
- else scaled from a reference (lib/project/seed_reference.py): the seed's GPU measurement, and, where the work runs
  on a CPU (no GPU here, or the setting says cpu), the demo's 2-core CPU measurement for training. A CPU's
  precompute pace is not known before its first shard: it depends on the teacher far more than on the prompts.

`gguf-trainer estimate` prints these lines.
"""

from __future__ import annotations

from types import SimpleNamespace

from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.seed_reference import (
    DEMO_CPU_PRECOMPUTE,
    DEMO_CPU_TRAINING,
    DEMO_CPU_TRAINING_SHAPE,
    DEMO_TEACHER,
    SEED_PRECOMPUTE,
    SEED_TRAINING,
    SEED_TRAINING_SHAPE,
    Measured,
)
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice
from gguf_assets.lib.status.pace import MeasuredRate, pace_view, precompute_pace, precompute_rate, training_pace
from gguf_assets.lib.status.states import ProjectView
from gguf_assets.lib.telemetry.curves_log import run_name
from gguf_assets.lib.telemetry.progress import format_seconds
from gguf_assets.lib.training.training_run import newest_meta

MEASURED_HERE = "measured on this machine"


def time_lines(paths: ProjectPaths, settings: Settings, *, gpus: list[dict] | None = None) -> list[str]:
    """One line for the precompute, one for training. ``gpus``: this machine's (gpu_snapshot's), read when not
    given; without one, or with the stage's device set to cpu, the work runs on the CPU."""
    if gpus is None:
        from gguf_assets.lib.telemetry.hardware import gpu_snapshot

        gpus = gpu_snapshot()
    view = pace_view(paths, settings)  # one reading of the corpus for both lines; None: nothing to measure yet
    return [_precompute_line(paths, settings, view, on_gpu=bool(gpus) and settings.precompute.device != "cpu"),
            _training_line(paths, settings, view, on_gpu=bool(gpus) and settings.training.device != "cpu")]


def _took(reference: Measured) -> str:
    return f"{reference.amount:,} {reference.unit} in {format_seconds(reference.hours * 3600)}"


def _about(seconds: float) -> str:
    return "under 1s" if seconds < 1 else f"about {format_seconds(seconds)}"  # "about 0s" reads as a fault


def _precompute_line(paths: ProjectPaths, settings: Settings, view: ProjectView | None, *, on_gpu: bool) -> str:
    if view is not None and (running := precompute_pace(paths, settings, view)) is not None:
        return f"{running.text()} ({MEASURED_HERE})"
    prompts = settings.corpus.train_prompts + settings.corpus.val_prompts
    if view is not None and (rate := precompute_rate(paths, view)) is not None:
        return (f"precompute: {_about(prompts / rate.per_second)} for {prompts:,} prompts, {MEASURED_HERE} "
                f"({rate.per_second:.1f} prompts/s over the {rate.source}); loading the models comes on top")
    if not teacher_choice(settings).loads_teacher_model:
        return (f"precompute: {prompts:,} prompts with no teacher model to run (precompute.mode, mock teacher): "
                "the seed's teacher figure does not apply; `gguf-trainer status` shows the measured rate and ETA "
                "from the first shard on")
    on_seed_gpu = (f"{_about(prompts / SEED_PRECOMPUTE.per_second)} of teacher time for {prompts:,} prompts, "
                   f"scaled from the seed's measurement ({SEED_PRECOMPUTE.text()}, a 30 GB MoE teacher all on the "
                   "GPU)")
    if on_gpu:
        return (f"precompute: {on_seed_gpu}; a smaller GPU, an offloaded teacher or another teacher size changes "
                "it. From the first shard on, `gguf-trainer status` shows this machine's measured rate and ETA")
    return (f"precompute on this machine's CPU ({_cpu_reason('precompute', settings.precompute.device)}): not known "
            "before its first shard, since a CPU's pace hangs on the teacher's size and the cores, and no CPU run of "
            f"this teacher was measured (the demo's, {DEMO_TEACHER}: {_took(DEMO_CPU_PRECOMPUTE)} on "
            f"{DEMO_CPU_PRECOMPUTE.where}). `gguf-trainer status` shows the measured rate and ETA from the first "
            f"shard on. On a GPU like the seed's: {on_seed_gpu}")


def _cpu_reason(section: str, device: str) -> str:
    return f"{section}.device is cpu" if device == "cpu" else "no NVIDIA GPU here"


def _work_per_step(shape: dict) -> float:
    """The adapter's work per step, up to a constant: batch x depth x width squared (its matmuls)."""
    return shape["batch_size"] * shape["depth"] * shape["width"] ** 2


def _training_line(paths: ProjectPaths, settings: Settings, view: ProjectView | None, *, on_gpu: bool) -> str:
    if view is not None and (running := training_pace(paths, settings, view)) is not None:
        return f"{running.text()} ({MEASURED_HERE})"
    t = settings.training
    shape = {"width": t.width, "depth": t.depth, "batch_size": t.batch_size}
    if (measured := training_rate(paths, None if view is None else view.adapter_fp)) is not None:
        rate, run_shape = measured
        scale = _work_per_step(shape) / _work_per_step(run_shape)
        return (f"training: {_about(t.steps / rate.per_second * scale)} for {t.steps:,} steps, {MEASURED_HERE} "
                f"({rate.per_second:.1f} steps/s: {rate.source}"
                + ("" if scale == 1 else ", scaled to these settings by batch x depth x width squared") + ")")

    def seconds_from(reference: Measured, reference_shape: dict) -> float:
        return t.steps / reference.per_second * _work_per_step(shape) / _work_per_step(reference_shape)

    ref, demo, rule = SEED_TRAINING_SHAPE, DEMO_CPU_TRAINING_SHAPE, "by steps x batch x depth x width squared"
    from_seed = (f"scaled from the seed's measurement ({SEED_TRAINING.text()} at width {ref['width']}, depth "
                 f"{ref['depth']}, batch {ref['batch_size']})")
    on_seed_gpu = _about(seconds_from(SEED_TRAINING, ref))
    if on_gpu:
        return f"training: {on_seed_gpu} on a GPU like the seed's for {t.steps:,} steps, {from_seed} {rule}"
    return (f"training on this machine's CPU ({_cpu_reason('training', t.device)}): "
            f"{_about(seconds_from(DEMO_CPU_TRAINING, demo))} for {t.steps:,} steps, scaled from the demo's "
            f"measurement on {DEMO_CPU_TRAINING.where} ({_took(DEMO_CPU_TRAINING)} at width {demo['width']}, depth "
            f"{demo['depth']}, batch {demo['batch_size']}) {rule}; other CPUs differ. On a GPU like the seed's: "
            f"{on_seed_gpu}, {from_seed}")


def training_rate(paths: ProjectPaths, adapter_fp: str | None) -> tuple[MeasuredRate, dict] | None:
    """This machine's steps/s of training and the adapter shape it was measured at: from the run these settings
    make where it trained, else from the newest run of the project that did; its steps over its recorded training
    time (validations and checkpoints included), else its last log step's steps/s. None before any."""
    root = paths.root / "checkpoints"
    metas = {d.name: newest_meta(d) or {} for d in (root.iterdir() if root.is_dir() else [])
             if d.is_dir() and not d.name.startswith(".")}
    for fingerprint in sorted(metas, key=lambda fp: (fp == adapter_fp, metas[fp].get("started_at") or 0),
                              reverse=True):
        meta = metas[fingerprint]
        training, step, seconds = meta.get("training") or {}, meta.get("step"), meta.get("train_seconds")
        logged = [e["steps_per_s"] for e in meta.get("history") or [] if isinstance(e, dict)
                  and isinstance(e.get("steps_per_s"), (int, float)) and e["steps_per_s"] > 0]
        try:
            shape = {key: int(training[key]) for key in ("width", "depth", "batch_size")}
            name = run_name(SimpleNamespace(**training), fingerprint)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if isinstance(step, int) and step > 0 and isinstance(seconds, (int, float)) and seconds > 0:
            return MeasuredRate(step / seconds, f"run {name}: {step:,} steps in {format_seconds(seconds)}"), shape
        if logged:
            return MeasuredRate(float(logged[-1]), f"run {name}, its last log step"), shape
    return None
