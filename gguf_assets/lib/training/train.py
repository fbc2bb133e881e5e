"""Adapter training: the trainer8 loss and schedule over streamed shards, validation, exact resume.

What a run is (its fingerprint: the result settings and the shards' fingerprints), why a new
run starts (``why_new_run``), and the loop (``train_adapter``). The data order and streaming
are in lib/training/train_data.py, the checkpoints in lib/training/checkpoints.py (docs/adapter.md).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE, VAL_LOSS
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    CURVES_FILE,
    DAMAGED_FINAL_DIR,
    FINAL_DIR,
    META_FILE,
    ProjectPaths,
)
from gguf_assets.lib.project.settings import PROJECT_FILE, Settings, load_settings
from gguf_assets.lib.telemetry.curves_log import CurvesLog, run_folder
from gguf_assets.lib.telemetry.eta import Pace, pace
from gguf_assets.lib.telemetry.hardware import resolve_device
from gguf_assets.lib.telemetry.progress import format_seconds
from gguf_assets.lib.telemetry.render import curves_svg
from gguf_assets.lib.training.adapter import (
    LR_SCALE,
    ROW_MEANS_INIT,
    Adapter,
    AdapterShape,
    adapter_loss,
    lr_at,
    parameter_groups,
    start_at_row_means,
)
from gguf_assets.lib.training.better import better_weights, with_better_weights
from gguf_assets.lib.training.checkpoints import (
    Resumed,
    final_is_intact,
    list_checkpoints,
    prune_checkpoints,
    restore,
    save_checkpoint,
    save_weights,
    set_aside_final,
)
from gguf_assets.lib.training.events import (
    CheckpointWritten,
    Finished,
    LogStep,
    NewBest,
    Note,
    OnEvent,
    TrainingEvent,
    Validation,
)
from gguf_assets.lib.training.input_peaks import INPUT_PEAKS, PeakRecorder, peaks_record
from gguf_assets.lib.training.kept_steps import (
    BY_REQUEST,
    BY_SCHEDULE,
    answer,
    asked,
    is_scheduled,
    kept_step_dir,
    prune_scheduled,
)
from gguf_assets.lib.training.optimizer import adamw
from gguf_assets.lib.training.precision import describe, step_autocast, step_precision, step_work
from gguf_assets.lib.training.stops import StopHold, is_stop
from gguf_assets.lib.training.train_data import (
    Batch,
    SampleOrder,
    ShardStream,
    TrainingError,
    shard_batches,
    shard_size,
    target_stats,
)
from gguf_assets.lib.training.training_run import (
    LINEAGE_FILE,
    NON_RESULT_KEYS,
    OFF_VALUES,
    SESSION_FAILED,
    SESSION_RUNNING,
    SESSION_STOPPED,
    PlannedRun,
    TrainedAdapter,
    end_session,
    record_finished_run,
    remember_lowered,
    remember_run,
    shards_identity,
    write_session,
)
from gguf_assets.lib.training.val_scores import ValScores
from gguf_assets.lib.training.verdict import training_start, validation_curve, verdict

log = logging.getLogger(__name__)

class _StepsInForce:
    """training.steps as project.yaml says now (read again only when the file's stamp changes): lowering it while
    the run trains ends the run at the current step. None when the file does not load (a typo being fixed)."""

    def __init__(self, paths: ProjectPaths) -> None:
        self.file, self.stamp, self.value = paths.root / PROJECT_FILE, None, None

    def steps(self) -> int | None:
        try:
            stat = self.file.stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp != self.stamp:
            self.stamp = stamp
            try:
                self.value = load_settings(self.file.parent).training.steps
            except Exception:  # noqa: BLE001 - any file that does not load: the plan stands
                self.value = None
        return self.value


# -- validation ---------------------------------------------------------------------------

@torch.inference_mode()
def evaluate(model: Adapter, folders: list[Path], *, device: torch.device, cosine_weight: float,
             relational_weight: float = 0.0, batch_size: int = 64) -> dict:
    """The val scores of the torch model (``_val_scores``) and, under INPUT_PEAKS, the record of the largest input
    each linear saw on the way, which the export's f16 rule reads (lib/training/input_peaks.py)."""
    with PeakRecorder(model) as recorder:
        scores = _val_scores(model, folders, device=device, cosine_weight=cosine_weight,
                             relational_weight=relational_weight, batch_size=batch_size)
    return {**scores, INPUT_PEAKS: peaks_record(recorder.peaks(), folders)}


def _val_scores(model: Adapter, folders: list[Path], *, device: torch.device, cosine_weight: float,
                relational_weight: float, batch_size: int) -> dict:
    """The val scores of the torch model in the raw target space (lib/core/metrics.py): centred cosine (overall,
    per shard, empty prompt), relative MSE, the cosine after a per-row RMSNorm and the worst query row; and the val
    loss."""
    was_training = model.training
    model.eval()
    cosines, empty, losses, per_shard = [], [], [], []
    scores = ValScores(model.target_centre)
    for folder in folders:
        shard_cos = []
        for shard, rows, states, mask, targets in shard_batches(folder, device=device, batch_size=batch_size):
            pred = model(states, mask)
            losses.append(float(adapter_loss(model.loss_space(pred.float()), model.loss_targets(targets),
                                             cosine_weight=cosine_weight, relational_weight=relational_weight))
                          * len(rows))
            cos = scores.add(model.to_target_space(pred.float()), targets).cpu()
            shard_cos += cos.tolist()
            empty += [c for c, i in zip(cos.tolist(), rows) if shard.texts[i] == ""]
        cosines += shard_cos
        per_shard.append({"shard": folder.name, "n": len(shard_cos),
                          VAL_CENTRED_COSINE: sum(shard_cos) / len(shard_cos)})
    model.train(was_training)
    n = len(cosines)
    return {VAL_CENTRED_COSINE: sum(cosines) / n,
            EMPTY_PROMPT_COSINE: (sum(empty) / len(empty)) if empty else None,
            **scores.result(), VAL_LOSS: sum(losses) / n, "per_shard": per_shard, "n": n}


# -- runs and settings changes ------------------------------------------------------------

def _run_meta(run_dir: Path) -> dict | None:
    for candidate in [run_dir / FINAL_DIR] + list(reversed(list_checkpoints(run_dir))):
        try:
            return atomic.read_json(candidate / META_FILE)
        except (OSError, ValueError):
            continue
    return None


def why_new_run(paths: ProjectPaths, fingerprint: str, training: dict, train_id: str, val_id: str) -> dict:
    """Compare with the most recently active other run: which settings or inputs changed."""
    runs = []
    for run in paths.checkpoints_dir(fingerprint).parent.glob("*"):
        if run.is_dir() and run.name != fingerprint:
            meta = _run_meta(run)
            if meta is not None:
                runs.append((max(p.stat().st_mtime for p in [run, *run.iterdir()]), run.name, meta))
    if not runs:
        return {"previous_run": None, "message": f"starting training run {fingerprint} (no earlier run)"}
    _, name, meta = max(runs)
    old = {**OFF_VALUES, **meta.get("training", {})}  # a run from before a key existed ran with it off
    changed = {k: [old.get(k), v] for k, v in training.items() if k not in NON_RESULT_KEYS and old.get(k) != v}
    reasons = [f"training.{k}: {a!r} → {b!r}" for k, (a, b) in sorted(changed.items())]
    if meta.get("train_shards") not in (None, train_id):
        reasons.append("the train shards changed")
    if meta.get("val_shards") not in (None, val_id):
        reasons.append("the val shards changed")
    if not reasons:
        reasons.append("the trainer's data order or format changed")
    return {"previous_run": name, "changed": changed, "reasons": reasons,
            "message": f"{'settings' if changed else 'inputs'} changed since run {name} ({'; '.join(reasons)}); "
                       f"starting a new run {fingerprint} "
                       f"from step 0. The old run's checkpoints stay in checkpoints/{name} and are used again "
                       "if you change the settings back."}


# -- training -----------------------------------------------------------------------------

def adapter_shape(settings: Settings, folders: list[Path]) -> AdapterShape:
    teacher = atomic.read_json(folders[0] / "teacher.json")
    student = atomic.read_json(folders[0] / "student.json")
    t = settings.training
    return AdapterShape(student_dim=int(student["dim"]), query_rows=int(teacher["query_rows"]),
                        target_dim=int(teacher["dim"]), width=t.width, depth=t.depth)


def build_model(shape: AdapterShape, *, seed: int, grad_checkpoint: bool = False) -> Adapter:
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return Adapter(shape, grad_checkpoint=grad_checkpoint)


class WeightAverage:
    """An exponential moving average of the weights (``training.ema_decay``), a second Adapter.

    The decay after n updates is min(ema_decay, (1 + n) / (10 + n)): early, mostly random weights
    fade within tens of steps whatever the decay, so short runs profit too. It depends on the step
    alone, and the average is saved in each checkpoint, so a resumed run averages exactly as an
    uninterrupted one. The target statistics (buffers) are copied once; they never change.
    """

    def __init__(self, model: Adapter, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(model)
        self.model.grad_checkpoint = False
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: Adapter, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for average, weight in zip(self.model.parameters(), model.parameters()):
            average.lerp_(weight.detach(), 1.0 - decay)


def _non_finite_cause(step: int, what: str, value: float, *, batch: Batch, folders: list[Path], model: Adapter,
                      learning_rate: float) -> str:
    """A message naming the step and the most likely cause of a non-finite loss or gradient."""
    for i, (_, shard, row) in enumerate(batch.located):
        if not torch.isfinite(batch.states[i][batch.mask[i]]).all():
            return (f"step {step}: the {what} is {value}: the student states of prompt {row} in {folders[shard]} are "
                    "not finite. Recompute that shard's student half (delete its student.json) and rerun.")
        if not torch.isfinite(batch.targets[i]).all():
            return (f"step {step}: the {what} is {value}: the target of prompt {row} in {folders[shard]} is not "
                    "finite. "
                    "Recompute that shard's teacher half (delete its teacher.json) and rerun.")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    where = f" (non-finite weights: {', '.join(bad[:3])})" if bad else ""
    return (f"step {step}: the {what} is {value}; the batch is finite, so training diverged{where}. Likely cause: "
            f"training.learning_rate ({learning_rate}) is too high; lower it, keep training.grad_clip on, or lengthen "
            "training.warmup_steps. No checkpoint was written for this step; the last good one is kept.")


def train_adapter(paths: ProjectPaths, settings: Settings, *, train_folders: list[Path], val_folders: list[Path],
                  fingerprint: str, on_event: OnEvent | None = None,
                  stop_after: int | None = None, sample_hardware: Callable[[], dict] | None = None,
                  planned: PlannedRun | None = None) -> TrainedAdapter:
    """Train (or resume) the run ``fingerprint``; returns its result (a paused one with ``stop_after``).

    ``on_event(event)`` receives each ``TrainingEvent`` (lib/training/events.py): a ``Note`` (a message),
    ``LogStep``, ``Validation``, ``NewBest``, ``CheckpointWritten`` and ``Finished``. ``stop_after`` ends the call
    after that many steps without finishing (tests, pausing); the next call resumes from the last checkpoint.
    ``sample_hardware()`` (GPU/CPU/RAM figures) is called at each log step; its figures go to
    the ``LogStep`` and to TensorBoard (<project>/tensorboard/<fingerprint>, lib/telemetry/curves_log.py).
    ``planned`` (training_run.planned_run) says whether the run continues a parent run (it starts from the
    parent's newest checkpoint) and its lineage; None: a run of its own.
    """
    planned = planned or PlannedRun(fingerprint, "", settings.training.steps)
    run = _TrainingRun(paths, settings, train_folders, val_folders, fingerprint, planned=planned,
                       emit=on_event or _ignore, sample_hardware=sample_hardware)
    summary = run.already_finished()
    if summary is None:
        run.start_or_resume()
        summary = run.train(stop_after)
    result = TrainedAdapter.from_summary(summary)
    if result.finished:
        record_adapter(paths, settings, result)
    return result


def _ignore(_event: TrainingEvent) -> None:
    pass


def record_adapter(paths: ProjectPaths, settings: Settings, result: TrainedAdapter) -> None:
    """checkpoints/final.json names the finished run (training_run.record_finished_run)."""
    record_finished_run(paths, result.fingerprint, settings_hash=settings_history.remember(paths.root, settings),
                        val_centred_cosine=result.val_centred_cosine)


class _TrainingRun:
    """One training run, step by step: ``start_or_resume``, then ``train`` (its loop calls ``_step``,
    then ``_log``, ``_validate`` and ``_checkpoint`` at their cadence), then ``_finish``."""

    def __init__(self, paths: ProjectPaths, settings: Settings, train_folders: list[Path], val_folders: list[Path],
                 fingerprint: str, *, planned: PlannedRun, emit: OnEvent,
                 sample_hardware: Callable[[], dict] | None) -> None:
        self.paths, self.t, self.settings = paths, settings.training, settings
        self.train_folders, self.val_folders, self.fingerprint = train_folders, val_folders, fingerprint
        self.planned = planned
        self.emit, self.sample_hardware = emit, sample_hardware
        self.device = resolve_device(self.t.device)
        self.run_dir = paths.checkpoints_dir(fingerprint)
        self.last_validation: tuple[int, dict] | None = None  # (step, metrics): a kept step at that step reuses it
        self.lowered_to: int | None = None  # training.steps lowered below the current step: the run ends now
        self.steps_source = _StepsInForce(paths)

    def note(self, message: str, *, warning: bool = False) -> None:
        (log.warning if warning else log.info)("%s", message)
        self.emit(Note(message, warning=warning))

    def _evaluate(self, model: Adapter) -> dict:
        return evaluate(model, self.val_folders, device=self.device, cosine_weight=self.t.cosine_weight,
                        relational_weight=self.t.relational_weight)

    def already_finished(self) -> dict | None:
        """The summary of a finished run whose weights are intact; damaged ones are set aside."""
        final_dir = self.run_dir / FINAL_DIR
        if (final_dir / META_FILE).is_file():
            if final_is_intact(self.run_dir):
                self.note(f"training run {self.fingerprint} already finished; reusing {final_dir}")
                return atomic.read_json(final_dir / META_FILE)
            set_aside_final(self.run_dir)
            self.note(f"the finished weights in {final_dir} are damaged (their bytes differ from the recorded "
                      f"sha256); moved them to {DAMAGED_FINAL_DIR} and training the last steps again from the "
                      "newest intact checkpoint", warning=True)
        if not self.train_folders or not self.val_folders:
            raise TrainingError("training needs at least one train shard and one val shard")
        return None

    def start_or_resume(self) -> None:
        """The model and optimizer, from the newest intact checkpoint or freshly initialized."""
        t = self.t
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic.remove_stale_temps(self.run_dir)
        shape = adapter_shape(self.settings, self.train_folders)
        self.work = step_work(batch_size=t.batch_size, query_rows=shape.query_rows, width=shape.width)
        self.precision = step_precision(t.precision, self.device, work=self.work)
        self.model = build_model(shape, seed=t.seed, grad_checkpoint=t.grad_checkpoint).to(self.device)
        self.optimizer = adamw(parameter_groups(self.model, query_lr_scale=t.query_lr_scale), lr=t.learning_rate,
                               weight_decay=t.weight_decay)
        self.sizes = [shard_size(f) for f in self.train_folders]
        train_id, val_id = shards_identity(self.train_folders), shards_identity(self.val_folders)
        # The whole settings snapshot too (by its hash): `gguf-trainer runs` diffs a run against project.yaml by it,
        # and `--use` puts it back.
        self.settings_hash = settings_history.remember(self.paths.root, self.settings)
        self.base_meta = {"fingerprint": self.fingerprint, "shape": shape.to_dict(),
                          "training": self.settings.section_dict("training"), "train_prompts": sum(self.sizes),
                          "train_shards": train_id, "val_shards": val_id, "format": formats.TRAINING_RUN,
                          "settings_hash": self.settings_hash, "precision": self.precision}
        if self.planned.parent:
            self.base_meta["parent"] = self.planned.parent
        if self.planned.lineage:
            remember_run(self.paths, self.planned)
        resumed = restore(self.run_dir, self.model, self.optimizer, self.device, shape, ema=t.ema_decay > 0)
        if resumed is None and self.planned.parent:  # a continuation's first session: from the parent's newest step
            parent_dir = self.paths.checkpoints_dir(self.planned.parent)
            resumed = restore(parent_dir, self.model, self.optimizer, self.device, shape, ema=t.ema_decay > 0)
            if resumed is None:
                raise TrainingError(f"training run {self.fingerprint} continues run {self.planned.parent}, which has "
                                    f"no intact checkpoint left in {parent_dir}; set training.steps back, or delete "
                                    f"{self.paths.root / 'checkpoints' / LINEAGE_FILE} to train from step 0")
            resumed.started_at = None  # the continuation starts now (`runs` lists it after its parent)
            resumed.started = {"previous_run": self.planned.parent, "continues": self.planned.parent,
                               "from_step": resumed.step,
                               "message": f"continuing run {self.planned.parent} from step {resumed.step} to "
                                          f"{t.steps} steps as run {self.fingerprint} (training.steps raised); the "
                                          f"learning rate follows the schedule of {t.steps} steps from here"}
            self.note(resumed.started["message"])
        elif resumed is not None:
            self.note(f"resuming training run {self.fingerprint} from {resumed.checkpoint} "
                      f"(step {resumed.step} of {t.steps})")
        else:
            resumed = Resumed()
            resumed.started = why_new_run(self.paths, self.fingerprint, self.base_meta["training"], train_id, val_id)
            self.note(resumed.started["message"], warning=bool(resumed.started.get("previous_run")))
            # Statistics travel in every checkpoint's weights, so a resume never rereads the whole train set.
            stats = target_stats(self.train_folders, sigma_floor=t.sigma_floor,
                                 isotropic=t.target_standardization == "isotropic")
            self.model.target_centre.copy_(stats.centre)
            self.model.target_std.copy_(stats.output_std)
            self.model.loss_std.copy_(stats.loss_std)
            if t.init == ROW_MEANS_INIT:  # from the statistics, so only here: a resume has its weights
                start_at_row_means(self.model, seed=t.seed)
            untrained = self._evaluate(self.model)
            resumed.untrained = untrained[VAL_CENTRED_COSINE]
            self.note(f"untrained adapter: val centred cosine {resumed.untrained:.4f}")
        self.step, self.history, self.best, self.untrained = resumed.step, resumed.history, resumed.best, \
            resumed.untrained
        log.info("%s", describe(t.precision, self.device, work=self.work))
        self.base_meta["started"] = resumed.started
        self.base_meta["started_at"] = resumed.started_at or round(time.time(), 1)
        # Wall time adds up over the sessions (each checkpoint carries the sum up to it), so a run stopped and
        # resumed says how long it trained, not how long its last session did.
        self.seconds_before, self.session_start = resumed.train_seconds, time.perf_counter()
        write_session(self.run_dir, SESSION_RUNNING, step=self.step, settings_hash=self.settings_hash)
        # With the average on, it is what is validated and kept (best/, final/); training steps the raw weights.
        self.average = WeightAverage(self.model, t.ema_decay) if t.ema_decay > 0 else None
        if self.average is not None and resumed.ema is not None:
            self.average.model.load_state_dict(resumed.ema)
        self.judged = self.average.model if self.average is not None else self.model

    def train(self, stop_after: int | None) -> dict:
        t = self.t
        order = SampleOrder(self.sizes, t.seed)
        stop_at = t.steps if stop_after is None else min(t.steps, self.step + stop_after)
        self.curves = CurvesLog(run_folder(self.paths.root, self.t, self.fingerprint), resumed_at_step=self.step)
        if self.untrained is not None and self.step == 0:
            self.curves.scalars(0, {VAL_CENTRED_COSINE: self.untrained}, "val")
        self.stream = ShardStream(self.train_folders, order, batch_size=t.batch_size, end_step=stop_at)
        self.model.train()
        self.clock_from = (time.perf_counter(), self.step)  # this process's steps: the ETA's rate
        self._start_window()
        saved_at = self.step  # the step the newest checkpoint holds
        hold = StopHold()
        try:
            while self.step < stop_at:
                # A stop (Ctrl-C, SIGTERM, Terminate) is held until the step and its bookkeeping are done, so the
                # state is whole at any stop, and the checkpoint below resumes byte-identically.
                with hold:
                    lr = lr_at(self.step, peak=t.learning_rate, warmup=t.warmup_steps, total=t.steps)
                    loss, grad_norm = self._step(lr)
                    if self.step % t.log_every == 0 or self.step == t.steps:
                        self._log(loss, lr, grad_norm)
                    elif self.step == self.clock_from[1] + 1:  # this process's first step: shown at once
                        self._first_step_line(loss)
                    if self.step % t.validate_every == 0 or self.step == t.steps:
                        self._validate()
                    if self.step % t.checkpoint_every == 0 or self.step == t.steps:
                        self._checkpoint()
                        saved_at = self.step
                    requests = asked(self.run_dir)
                    if requests:  # snapshots: kept, checkpointed, every pending one answered; training goes on
                        self._keep_step(BY_REQUEST)
                        if saved_at != self.step:
                            self._checkpoint()
                            saved_at = self.step
                        answer(self.run_dir, requests, self.step)
                    elif is_scheduled(self.step, every=t.keep_steps_every, first=t.keep_steps_from,
                                      last=t.keep_steps_to, planned=t.steps):
                        self._keep_step(BY_SCHEDULE)
                    if self.step % t.log_every == 0 and self._lowered_below_current_step():
                        # The end is validated like a planned last step: its score is the chart's last point,
                        # and best/ sees it.
                        if self.last_validation is None or self.last_validation[0] != self.step:
                            self._validate()
                        if saved_at != self.step:
                            self._checkpoint()
                            saved_at = self.step
                        break
        except BaseException as exc:
            if is_stop(exc) and hold.forced:
                self.note(f"stopped mid-step (a stop waited {hold.max_hold_s:.0f} s for step {self.step + 1} to "
                          f"end, or came twice): the next run continues from step {saved_at}, its last checkpoint")
            elif is_stop(exc) and self.step > saved_at:  # Stop keeps the work: the steps since the last checkpoint
                with StopHold():
                    self._checkpoint()
                    saved_at = self.step
                self.note(f"stopped at step {self.step} of {t.steps}: checkpoint written, the next run continues "
                          "from this step")
            with StopHold():
                self._end_session(exc, saved_at)
            raise
        finally:
            self.stream.close()
            self.curves.close()
        if self.step < t.steps and self.lowered_to is None:
            write_session(self.run_dir, SESSION_STOPPED, step=self.step, settings_hash=self.settings_hash,
                          message=f"paused after {self.step} of {t.steps} steps")
            return {"finished": False, "step": self.step, "fingerprint": self.fingerprint}
        return self._finish()

    def _lowered_below_current_step(self) -> bool:
        """training.steps lowered in project.yaml to at most the current step while the run trains: it ends now
        (validated, checkpointed, then exported and evaluated as usual), and stands for the lowered count."""
        now = self.steps_source.steps()
        if now is None or now >= self.t.steps or now > self.step:
            return False
        self.lowered_to = now
        self.note(f"training.steps was lowered to {now} while the run trained: it ends now, at step {self.step} "
                  f"of the {self.t.steps} planned")
        return True

    def _keep_step(self, kept_by: str) -> None:
        """The judged weights at this step, validated, as a kept step (kept_steps.py): a snapshot's source, or the
        schedule's. The run's history, best weights and data order are untouched."""
        t = self.t
        if self.last_validation is not None and self.last_validation[0] == self.step:
            metrics = self.last_validation[1]
        else:
            metrics = self._evaluate(self.judged)
        scores = {k: metrics[k] for k in (VAL_CENTRED_COSINE, EMPTY_PROMPT_COSINE, VAL_LOSS)}
        save_weights(kept_step_dir(self.run_dir, self.step), model=self.judged, step=self.step,
                     meta={**self.base_meta, "step": self.step, "planned_steps": t.steps, "kept_by": kept_by,
                           **scores, INPUT_PEAKS: metrics[INPUT_PEAKS]})
        pruned = prune_scheduled(self.run_dir, t.keep_steps_last)
        if kept_by == BY_REQUEST:
            self.note(f"snapshot: step {self.step} kept (val centred cosine {scores['val_centred_cosine']:.4f}); "
                      "training goes on")
        elif pruned:
            log.info("kept step %d; removed kept step(s) %s (training.keep_steps_last = %d)", self.step,
                     ", ".join(map(str, pruned)), t.keep_steps_last)

    def _end_session(self, exc: BaseException, saved_at: int) -> None:
        """Say how the session ended (`gguf-trainer runs` shows it): stopped on purpose, or failed and why. A
        record that cannot be written must not hide the error that ended the run."""
        stopped = is_stop(exc)
        message = (f"stopped at step {saved_at} of {self.t.steps}" if stopped
                   else (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500])
        message = message.replace(f"{self.paths.root}/", "")  # the project's own paths, relative: it may move
        try:
            write_session(self.run_dir, SESSION_STOPPED if stopped else SESSION_FAILED, step=saved_at,
                          message=message, settings_hash=self.settings_hash)
        except OSError as record_error:  # a full disk, say: the run's own error is what the user must see
            log.warning("could not record how training ended in %s: %s", self.run_dir, record_error)

    def _step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the batch of this step; a non-finite loss or gradient stops with its cause.

        Returns the loss and gradient norm as tensors: reading them (a device sync) waits for a log step.
        """
        t, model = self.t, self.model
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get(LR_SCALE, 1.0)
        batch = self.stream.batch(self.step)
        states, mask = batch.states.to(self.device), batch.mask.to(self.device)
        targets = batch.targets.to(self.device)
        with step_autocast(self.precision, self.device):
            pred = model(states, mask)
        loss = adapter_loss(model.loss_space(pred.float()), model.loss_targets(targets),
                            cosine_weight=t.cosine_weight, relational_weight=t.relational_weight)
        self.optimizer.zero_grad(set_to_none=True)
        if torch.isfinite(loss):
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
            what, value = (("loss", float(loss.detach())) if not torch.isfinite(loss)
                           else ("gradient norm", float(grad_norm)))
            raise TrainingError(_non_finite_cause(self.step, what, value, batch=batch, folders=self.train_folders,
                                                  model=model, learning_rate=t.learning_rate))
        self.optimizer.step()
        self.step += 1
        if self.average is not None:
            self.average.update(model, self.step)
        faults.point("train-step")
        self.window_steps += 1
        return loss.detach(), grad_norm

    def _pace(self) -> Pace:
        """Steps/s of this process's steps so far, validations and checkpoints included (a resumed run counts
        from where it resumed, so the steps it skipped do not make the ETA short), and the time left at it."""
        started, first_step = self.clock_from
        rate = (self.step - first_step) / max(time.perf_counter() - started, 1e-9)
        return pace("training", "steps", self.step, self.t.steps, rate)

    def _eta_s(self) -> float:
        return self._pace().seconds_left

    def _start_window(self) -> None:
        """Throughput is measured over the steps since the last log line."""
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.window_wait, self.window_bytes = self.stream.wait_seconds, self.stream.stats.bytes

    def _first_step_line(self, loss: torch.Tensor) -> None:
        """A console line for the first step this process trains, so training is seen to have started (the full
        line, with the rates, comes every log_every steps; this one adds nothing to the history or the curves). No
        ETA yet: one step's time, with its warm-up, gave 38 minutes for the demo's 2."""
        log.info("step %d/%d loss %.4f (training started; the full line, with the rate and ETA, every %d steps)",
                 self.step, self.t.steps, float(loss), self.t.log_every)

    def _log(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> None:
        t, stream = self.t, self.stream
        elapsed = time.perf_counter() - self.window_start
        eta_s = self._eta_s()
        # The console's ETA goes with the event (not the history: it is about this process), so the studio's
        # progress bar says what the console says.
        event = LogStep(step=self.step, loss=float(loss), lr=lr, grad_norm=float(grad_norm),
                        steps_per_s=self.window_steps / elapsed,
                        samples_per_s=self.window_steps * t.batch_size / elapsed,
                        data_wait_fraction=(stream.wait_seconds - self.window_wait) / elapsed,
                        read_mb_per_s=(stream.stats.bytes - self.window_bytes) / 1e6 / elapsed,
                        hardware=self.sample_hardware() if self.sample_hardware else {},
                        eta_s=round(eta_s, 1) if math.isfinite(eta_s) else None)
        entry = event.history_entry()
        self.history.append(entry)
        log.info("step %d/%d loss %.4f lr %.2e grad %.3f %.2f steps/s %.1f samples/s, ETA %s", self.step, t.steps,
                 event.loss, lr, event.grad_norm, event.steps_per_s, event.samples_per_s, format_seconds(eta_s))
        self.curves.scalars(self.step, entry, "train")
        self.curves.scalars(self.step, dict(event.hardware), "hardware")
        # `status` reads the step and the rate from the session, from the first log step on.
        write_session(self.run_dir, SESSION_RUNNING, step=self.step, settings_hash=self.settings_hash,
                      steps_per_s=round(self._pace().rate, 4))
        self.emit(event)
        self._start_window()

    def _validate(self) -> None:
        metrics = self._evaluate(self.judged)
        validation = Validation.of(self.step, metrics)
        entry = validation.figures()
        self.history.append(entry)
        self.curves.scalars(self.step, entry, "val")
        empty = metrics[EMPTY_PROMPT_COSINE]
        log.info("step %d: val centred cosine %.4f (empty prompt %s), val loss %.4f", self.step,
                 metrics[VAL_CENTRED_COSINE], "n/a" if empty is None else f"{empty:.4f}", metrics[VAL_LOSS])
        self.last_validation = (self.step, metrics)
        self.emit(validation)
        if self.best is None or metrics[VAL_CENTRED_COSINE] > self.best[VAL_CENTRED_COSINE]:
            self.best = {"step": self.step, VAL_CENTRED_COSINE: metrics[VAL_CENTRED_COSINE],
                         EMPTY_PROMPT_COSINE: metrics[EMPTY_PROMPT_COSINE], VAL_LOSS: metrics[VAL_LOSS]}
            save_weights(self.run_dir / BEST_DIR, model=self.judged, step=self.step,
                         meta={**self.base_meta, **self.best, INPUT_PEAKS: metrics[INPUT_PEAKS]})
            self.emit(NewBest(**self.best))
        # A checkpoint's time may not come for a while; keep the picture current for the UI.
        self._write_curves()

    def _checkpoint(self) -> None:
        t = self.t
        meta = {**self.base_meta, "history": self.history, "best": self.best, "untrained": self.untrained,
                "samples_seen": self.step * t.batch_size, "train_seconds": self._train_seconds(),
                "lr_next": lr_at(self.step, peak=t.learning_rate, warmup=t.warmup_steps, total=t.steps)}
        save_checkpoint(self.run_dir / f"step-{self.step:08d}", model=self.model, optimizer=self.optimizer,
                        step=self.step, meta=meta, ema=self.average.model if self.average is not None else None)
        prune_checkpoints(self.run_dir, t.keep_checkpoints)
        self.emit(CheckpointWritten(self.step))

    def _train_seconds(self) -> float:
        return round(self.seconds_before + time.perf_counter() - self.session_start, 1)

    def _write_curves(self) -> str:
        svg = curves_svg(self.history)
        atomic.write_text(self.run_dir / CURVES_FILE, svg)
        return svg

    def _finish(self) -> dict:
        final = self._evaluate(self.judged)
        end = {"step": self.step, VAL_CENTRED_COSINE: final[VAL_CENTRED_COSINE]}
        curve = validation_curve([*self.history, end])
        text, advice = verdict(final[VAL_CENTRED_COSINE], curve, width=self.t.width, steps=self.t.steps,
                               start=training_start(self.t))
        if self.lowered_to is not None:
            remember_lowered(self.paths, self.fingerprint, self.lowered_to)
        early = {} if self.lowered_to is None else {"planned_steps": self.t.steps, "lowered_to": self.lowered_to}
        summary = {**self.base_meta, **early, "finished": True, "step": self.step, "history": self.history,
                   "best": self.best,
                   "untrained_val_centred_cosine": self.untrained, "verdict": text, "advice": advice,
                   "read_mb_per_s": self.stream.stats.mb_per_s, "train_seconds": self._train_seconds(),
                   **{k: final[k] for k in (VAL_CENTRED_COSINE, EMPTY_PROMPT_COSINE, VAL_LOSS, "per_shard",
                                            INPUT_PEAKS)}}
        save_weights(self.run_dir / FINAL_DIR, model=self.judged, step=self.step, meta=summary,
                     extra={CURVES_FILE: self._write_curves()})
        end_session(self.run_dir)
        # Weights that scored higher (its best validation, the run it continues): said as the report says them, with
        # this project's commands. Only the note: final/meta.json keeps the trainer's own verdict and advice.
        better = better_weights(self.paths, summary, torch_score=final[VAL_CENTRED_COSINE], gguf_score=None)
        text, advice = with_better_weights(text, advice, better, trainer, self.paths.root)
        self.note(f"training finished: {text} {advice}")
        self.emit(Finished(step=self.step, val_centred_cosine=final[VAL_CENTRED_COSINE]))
        return summary
