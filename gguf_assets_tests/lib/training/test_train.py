"""Adapter training: exact resume (stop and kill -9), best/last checkpoints, bounded streaming
reads, settings changes, non-finite stops, and the curves image.

The shards are written here in the real on-disk shard format, with targets a fixed nonlinear
function of the states, so the trainer is tested on its own contract (and the adapter can
really learn them) in a few seconds.
"""

import base64
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.safetensors_io import read_torch
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    CURVES_FILE,
    FINAL_DIR,
    META_FILE,
    PROMPTS_FILE,
    STUDENT_FILE,
    TEACHER_FILE,
    WEIGHTS_FILE,
    ProjectPaths,
)
from gguf_assets.lib.project.settings import Settings, Training, load_settings, replace
from gguf_assets.lib.telemetry.curves_log import run_folder
from gguf_assets.lib.telemetry.render import curves_markdown, curves_svg
from gguf_assets.lib.training.checkpoints import list_checkpoints, load_final
from gguf_assets.lib.training.events import Finished, LogStep, Note, Validation
from gguf_assets.lib.training.input_peaks import measure_peaks, recorded_peaks
from gguf_assets.lib.training.train import train_adapter
from gguf_assets.lib.training.train_data import SampleOrder, ShardStream, TrainingError
from gguf_assets.lib.training.training_run import TrainedAdapter, shards_identity, training_fingerprint

STUDENT_DIM, QUERY_ROWS, TARGET_DIM = 24, 8, 16
SETTINGS = Settings(training=Training(width=64, depth=1, steps=40, batch_size=8, learning_rate=3e-3,
                                      warmup_steps=4, device="cpu", log_every=5, validate_every=10,
                                      checkpoint_every=5, keep_checkpoints=2, seed=3))


def write_shards(folder: Path, *, shards: int, prompts: int, seed: int, bad_states: tuple[int, int] | None = None,
                 bad_target: tuple[int, int] | None = None) -> list[Path]:
    """Shard folders as lib/precompute/shards.py writes them; the first prompt of shard 0 is the empty prompt."""
    g = torch.Generator().manual_seed(1234)  # the "teacher" is the same function for every shard set
    w1 = torch.randn(STUDENT_DIM, 32, generator=g) * 0.3
    w2 = torch.randn(32, QUERY_ROWS * TARGET_DIM, generator=g) / 32 ** 0.5
    cfg = torch.randn(QUERY_ROWS, TARGET_DIM, generator=g)
    rng = torch.Generator().manual_seed(seed)
    out = []
    for k in range(shards):
        lengths = torch.randint(1, 10, (prompts,), generator=rng)
        if k == 0:
            lengths[0] = 0
        states = [torch.randn(int(n), STUDENT_DIM, generator=rng) for n in lengths]
        targets = torch.stack([(s.mean(0) @ w1).sin() @ w2 if len(s) else cfg.flatten() for s in states])
        targets = targets.view(prompts, QUERY_ROWS, TARGET_DIM) * 3 + 1
        if bad_states and bad_states[0] == k:
            states[bad_states[1]][0, 0] = float("inf")
        if bad_target and bad_target[0] == k:
            targets[bad_target[1], 0, 0] = float("nan")
        shard = folder / f"{k:05d}"
        shard.mkdir(parents=True)
        texts = ["" if len(s) == 0 else f"prompt {k}-{i}" for i, s in enumerate(states)]
        atomic.write_text(shard / PROMPTS_FILE, "".join(json.dumps({"text": t}) + "\n" for t in texts))
        save_file({"targets": targets.half()}, str(shard / TEACHER_FILE))
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        save_file({"hidden": torch.cat(states).bfloat16(), "offsets": offsets,
                   "token_ids": torch.zeros(int(lengths.sum()), dtype=torch.int32)}, str(shard / STUDENT_FILE))
        atomic.write_json(shard / "teacher.json", {"fingerprint": f"t{seed}-{k}", "prompts": prompts,
                                                   "query_rows": QUERY_ROWS, "dim": TARGET_DIM})
        atomic.write_json(shard / "student.json", {"fingerprint": f"s{seed}-{k}", "dim": STUDENT_DIM})
        out.append(shard)
    return out


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return {"train": write_shards(root / "train", shards=5, prompts=40, seed=1),
            "val": write_shards(root / "val", shards=1, prompts=30, seed=2)}


def fingerprint_for(settings: Settings, shard_sets) -> str:
    return training_fingerprint(settings, [shards_identity(shard_sets["train"])], [shards_identity(shard_sets["val"])])


def train(root: Path, shard_sets, settings: Settings = SETTINGS, **kwargs) -> TrainedAdapter:
    return train_adapter(ProjectPaths.of(root), settings, train_folders=shard_sets["train"],
                         val_folders=shard_sets["val"], fingerprint=fingerprint_for(settings, shard_sets), **kwargs)


@pytest.fixture(scope="module")
def reference(shard_sets, tmp_path_factory):
    """One uninterrupted run, and every event it emitted."""
    root = tmp_path_factory.mktemp("reference")
    events = []
    summary = train(root, shard_sets, on_event=events.append)
    run_dir = ProjectPaths.of(root).checkpoints_dir(summary.fingerprint)
    return {"summary": summary, "run_dir": run_dir, "events": events,
            "weights": (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes()}


def test_uninterrupted_run_learns_and_reports(reference):
    s = reference["summary"]
    for key in ("shape", "fingerprint", "val_centred_cosine", "empty_prompt_cosine",
                "untrained_val_centred_cosine", "history", "per_shard", "val_loss", "best", "verdict", "advice"):
        assert getattr(s, key), key  # every figure of a finished run is there
    assert s.finished and s.step == SETTINGS.training.steps
    assert s.val_centred_cosine > s.untrained_val_centred_cosine + 0.15, s
    assert "below 0.9" in s.verdict or s.val_centred_cosine >= 0.9
    logs = [e for e in reference["events"] if isinstance(e, LogStep)]
    assert [e.step for e in logs] == [5, 10, 15, 20, 25, 30, 35, 40]
    for event in logs:
        assert all(isinstance(getattr(event, k), float) for k in ("loss", "lr", "grad_norm", "steps_per_s",
                                                                   "samples_per_s"))
        # What the adapter's observation records (the studio and Dagster's plots read these keys).
        assert list(event.figures()) == ["step", "loss", "lr", "grad_norm", "steps_per_s", "samples_per_s",
                                         "data_wait_fraction", "read_mb_per_s", "eta_s"]
    # The console's ETA rides along (the studio's progress bar shows it): 0 at the last step, not in the history.
    assert all(e.eta_s >= 0 for e in logs) and logs[-1].eta_s == 0 and logs[0].eta_s > 0
    assert not any("eta_s" in entry for entry in s.history)
    assert [e.history_entry() for e in logs] == [entry for entry in s.history if "loss" in entry]
    vals = [e for e in reference["events"] if isinstance(e, Validation)]
    assert [e.step for e in vals] == [10, 20, 30, 40]
    assert [e.figures() for e in vals] == [entry for entry in s.history if "val_loss" in entry]
    # Each validation's scores in the raw target space (lib/core/metrics.py), in the run's history per step.
    assert list(vals[0].figures()) == ["step", "val_centred_cosine", "empty_prompt_cosine", "val_loss", "val_rel_mse",
                                       "val_rms_cosine", "worst_row", "worst_row_cosine"]
    for e in vals:
        assert 0 < e.val_rel_mse < 2 and 0 < e.val_rms_cosine <= 1 and e.worst_row in range(QUERY_ROWS)
        assert -1 <= e.worst_row_cosine <= e.val_centred_cosine  # the lowest row's mean is at most the mean of all
    assert vals[-1].val_rel_mse < vals[0].val_rel_mse  # it learns: the error falls as the cosine rises
    assert isinstance(reference["events"][-1], Finished)
    model, meta = load_final(reference["run_dir"])
    assert meta["step"] == 40 and model.target_std.min() >= SETTINGS.training.sigma_floor


def test_keeps_last_checkpoints_and_the_best(reference):
    run_dir, summary = reference["run_dir"], reference["summary"]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000035", "step-00000040"]
    vals = [e for e in summary.history if "val_centred_cosine" in e]
    top = max(vals, key=lambda e: e["val_centred_cosine"])
    best_meta = atomic.read_json(run_dir / BEST_DIR / META_FILE)
    assert best_meta["step"] == top["step"] == summary.best["step"]
    best_weights = load_file(str(run_dir / BEST_DIR / WEIGHTS_FILE))
    assert set(best_weights) == set(load_file(str(run_dir / FINAL_DIR / WEIGHTS_FILE)))
    assert not [p for p in run_dir.iterdir() if p.name.startswith(atomic.TEMP_PREFIX)]


def test_stop_and_resume_is_bit_identical(shard_sets, reference, tmp_path):
    events = []
    first = train(tmp_path, shard_sets, stop_after=13, on_event=events.append)
    assert (first.finished, first.step, first.fingerprint) == (False, 13, reference["summary"].fingerprint)
    assert first.val_centred_cosine is None  # a paused run has no score yet
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(first.fingerprint)
    assert list_checkpoints(run_dir)[-1].name == "step-00000010"  # steps 11-13 are lost and redone
    second = train(tmp_path, shard_sets, on_event=events.append)
    assert any(isinstance(e, Note) and "resuming" in e.message and "step-00000010" in e.message for e in events)
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]
    # TensorBoard shows each step once: steps 11-13 of the stopped run are purged, redone ones kept.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves = EventAccumulator(str(run_folder(tmp_path, SETTINGS.training, first.fingerprint)))
    curves.Reload()
    assert [e.step for e in curves.Scalars("train/loss")] == list(range(5, 41, 5))
    losses = [e["loss"] for e in second.history if "loss" in e]
    assert losses == [e["loss"] for e in reference["summary"].history if "loss" in e]
    assert second.val_centred_cosine == reference["summary"].val_centred_cosine


KILL_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import Settings, Training
    from gguf_assets.lib.training.train import train_adapter

    root, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    def slow_down(event):  # widens the window for the kill; the math is untouched
        if type(event).__name__ == "LogStep":
            time.sleep(0.05)
    settings = Settings(training=Training(**spec["training"]))
    train_adapter(ProjectPaths.of(root), settings, train_folders=[Path(p) for p in spec["train"]],
                  val_folders=[Path(p) for p in spec["val"]], fingerprint=spec["fingerprint"], on_event=slow_down)
""")


def test_kill_9_mid_run_then_rerun_is_bit_identical(shard_sets, reference, tmp_path):
    settings = replace(SETTINGS, training={"log_every": 1})  # not a result setting: same fingerprint
    fingerprint = fingerprint_for(settings, shard_sets)
    assert fingerprint == reference["summary"].fingerprint
    spec = json.dumps({"training": settings.section_dict("training"), "fingerprint": fingerprint,
                       **{split: [str(p) for p in shard_sets[split]] for split in ("train", "val")}})
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(fingerprint)
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), spec], cwd=Path(__file__).parents[3],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(run_dir):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
        time.sleep(random.Random(0).uniform(0.0, 0.4))  # somewhere between checkpoints, maybe inside one
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    killed_at = [p.name for p in list_checkpoints(run_dir)]
    assert not (run_dir / FINAL_DIR).exists() and "step-00000040" not in killed_at, killed_at

    summary = train(tmp_path, shard_sets, settings)
    assert summary.finished
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(atomic.TEMP_PREFIX)]


def test_settings_change_starts_a_new_run_and_says_why(shard_sets, reference, tmp_path):
    notes = []
    train(tmp_path, shard_sets)
    old = fingerprint_for(SETTINGS, shard_sets)
    old_final = (ProjectPaths.of(tmp_path).checkpoints_dir(old) / FINAL_DIR / WEIGHTS_FILE).read_bytes()
    changed = replace(SETTINGS, training={"learning_rate": 1e-3})
    new = fingerprint_for(changed, shard_sets)
    assert new != old
    train(tmp_path, shard_sets, changed, stop_after=5,
          on_event=lambda e: notes.append(e) if isinstance(e, Note) else None)
    message = notes[0].message
    assert f"since run {old}" in message and "learning_rate: 0.003 → 0.001" in message and notes[0].warning
    meta = atomic.read_json(list_checkpoints(ProjectPaths.of(tmp_path).checkpoints_dir(new))[-1] / META_FILE)
    assert meta["started"]["previous_run"] == old and meta["step"] == 5
    # The old run is untouched and is reused as is when the settings go back.
    assert (ProjectPaths.of(tmp_path).checkpoints_dir(old) / FINAL_DIR / WEIGHTS_FILE).read_bytes() == old_final
    notes.clear()
    again = train(tmp_path, shard_sets, on_event=lambda e: notes.append(e) if isinstance(e, Note) else None)
    assert again.finished and "already finished" in notes[0].message
    # Bookkeeping settings do not start a new run.
    assert fingerprint_for(replace(SETTINGS, training={"log_every": 7, "device": "auto"}), shard_sets) == old


def test_sample_order_is_a_pure_function_of_seed_and_index():
    sizes = [7, 3, 11, 5, 9, 2]
    a, b = SampleOrder(sizes, seed=5, window_shards=2), SampleOrder(sizes, seed=5, window_shards=2)
    total = sum(sizes)
    indices = list(range(3 * total))
    forward = [a.locate(i) for i in indices]
    shuffled = indices[:]
    random.Random(1).shuffle(shuffled)
    assert {i: b.locate(i) for i in shuffled} == dict(zip(indices, forward))
    for epoch in range(3):
        seen = [(shard, row) for _, shard, row in forward[epoch * total:(epoch + 1) * total]]
        assert sorted(seen) == sorted((k, r) for k, n in enumerate(sizes) for r in range(n))  # each once per epoch
    assert forward[:total] != forward[total:2 * total]  # reshuffled per epoch
    # Within a window, consecutive samples mix shards (a shuffle buffer, not shard after shard).
    first_window = [shard for w, shard, _ in forward if w == 0]
    assert len(set(first_window[:6])) == 2
    assert [SampleOrder(sizes, seed=6).locate(i) for i in range(total)] != [SampleOrder(sizes, seed=5).locate(i)
                                                                           for i in range(total)]


def test_stream_memory_does_not_grow_with_shard_count(tmp_path):
    small = write_shards(tmp_path / "few", shards=4, prompts=20, seed=7)
    large = small + write_shards(tmp_path / "many", shards=36, prompts=20, seed=8)
    peaks = {}
    for name, folders in (("few", small), ("many", large)):
        order = SampleOrder([20] * len(folders), seed=0, window_shards=2)
        stream = ShardStream(folders, order)
        for step in range(len(folders) * 20 // 8 + 3):  # a little over one epoch
            batch = stream.samples(step * 8, 8)
            assert len(batch) == 8
        peaks[name] = stream.peak_windows
        resident = sum(len(f.result()) for f in stream._windows.values())
        assert resident <= 2 * order.window_shards
        stream.close()
    assert peaks["few"] == peaks["many"] == 2  # the window in use and the one being read ahead


def test_reader_matches_safetensors_and_rejects_truncation(tmp_path):
    tensors = {"odd_bf16": torch.randn(3, 5).bfloat16(), "offsets": torch.arange(7, dtype=torch.int64),
               "half": torch.randn(2, 3).half(), "f32": torch.randn(4), "ids": torch.arange(5, dtype=torch.int32),
               "empty": torch.zeros(0, 4)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    got = read_torch(path, chunk_bytes=7)  # chunking must not matter
    expected = load_file(str(path))
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"{path}: truncated"):
        read_torch(path)


def _first_step_using(shard: int, row: int, settings: Settings, sizes: list[int]) -> int:
    order = SampleOrder(sizes, settings.training.seed)
    return next(i for i in range(10 ** 6) if order.locate(i)[1:] == (shard, row)) // settings.training.batch_size


def test_non_finite_states_stop_at_the_step_naming_the_prompt(tmp_path):
    settings = replace(SETTINGS, training={"checkpoint_every": 1, "keep_checkpoints": 100})
    sizes = [40] * 3
    # Pick a prompt first used at step 3 or later, so good checkpoints exist before it.
    order = SampleOrder(sizes, settings.training.seed)
    _, shard, row = order.locate(5 * settings.training.batch_size)
    bad_step = _first_step_using(shard, row, settings, sizes)
    assert bad_step >= 3
    folders = {"train": write_shards(tmp_path / "train", shards=3, prompts=40, seed=1, bad_states=(shard, row)),
               "val": write_shards(tmp_path / "val", shards=1, prompts=10, seed=2)}
    with pytest.raises(TrainingError) as info:
        train(tmp_path / "project", folders, settings)
    message = str(info.value)
    assert f"step {bad_step}:" in message and f"prompt {row} in {folders['train'][shard]}" in message
    assert "student" in message
    run_dir = ProjectPaths.of(tmp_path / "project").checkpoints_dir(fingerprint_for(settings, folders))
    steps = [int(p.name.split("-")[1]) for p in list_checkpoints(run_dir)]
    assert max(steps) == bad_step  # every step before the bad one, none after
    for ckpt in list_checkpoints(run_dir):
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / WEIGHTS_FILE)).values())


def test_diverging_learning_rate_stops_with_advice(shard_sets, tmp_path):
    settings = replace(SETTINGS, training={"learning_rate": 1e30, "warmup_steps": 0, "grad_clip": 0.0,
                                           "checkpoint_every": 1})
    with pytest.raises(TrainingError, match=r"step \d+: the (loss|gradient norm) is (nan|inf).*learning_rate"):
        train(tmp_path, shard_sets, settings)
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(fingerprint_for(settings, shard_sets))
    for ckpt in list_checkpoints(run_dir):
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / WEIGHTS_FILE)).values())


def test_non_finite_target_is_named_before_training(tmp_path):
    folders = {"train": write_shards(tmp_path / "train", shards=2, prompts=10, seed=1, bad_target=(1, 4)),
               "val": write_shards(tmp_path / "val", shards=1, prompts=10, seed=2)}
    with pytest.raises(TrainingError, match=rf"{folders['train'][1] / TEACHER_FILE}: target of prompt 4"):
        train(tmp_path / "project", folders)


def test_curves_image_is_valid_svg_embedded_as_a_data_uri(reference):
    svg_file = reference["run_dir"] / FINAL_DIR / CURVES_FILE
    svg = svg_file.read_text()
    root = ET.fromstring(svg)
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 4  # loss, val loss, val cosine, empty-prompt cosine
    assert all(len(line.get("points").split()) >= 3 for line in lines)
    assert svg == (reference["run_dir"] / CURVES_FILE).read_text()
    markdown = curves_markdown(svg)
    assert markdown.startswith("![") and "](data:image/svg+xml;base64," in markdown and markdown.endswith(")")
    assert base64.b64decode(markdown.split("base64,")[1][:-1]).decode() == svg
    assert ET.fromstring(curves_svg([])) is not None  # no history yet: empty axes, no crash


def test_dagster_records_plottable_metrics_curves_and_verdict(make_project):
    """Through the real pipeline: numeric observations per log/validate step, and the Markdown metadata."""
    import dagster as dg

    from gguf_assets.orchestration.launching import run_pipeline

    paths = make_project(steps=20, mock_teacher=True, corpus={"train_prompts": 200, "val_prompts": 50},
                         precompute={"shard_size": 100, "val_shard_size": 50},
                         training={"log_every": 5, "validate_every": 10, "checkpoint_every": 10})
    run_pipeline(paths, echo=lambda _: None)
    instance = dg.DagsterInstance.get()
    records = instance.fetch_observations(dg.AssetKey("adapter"), limit=100).records
    metadata = [r.asset_observation.metadata for r in records]
    logged = [m for m in metadata if "loss" in m]
    validated = [m for m in metadata if "val_centred_cosine" in m]
    assert sorted(int(m["step"].value) for m in logged) == [5, 10, 15, 20]
    assert sorted(int(m["step"].value) for m in validated) == [10, 20]
    for m in logged:
        for key in ("loss", "lr", "grad_norm", "steps_per_s", "samples_per_s"):
            assert isinstance(m[key], dg.FloatMetadataValue), key
    for m in validated:
        for key in ("val_centred_cosine", "empty_prompt_cosine", "val_loss", "val_rel_mse", "val_rms_cosine",
                    "worst_row", "worst_row_cosine"):
            assert isinstance(m[key], dg.FloatMetadataValue), key
    event = instance.get_latest_materialization_event(dg.AssetKey("adapter"))
    result = event.asset_materialization.metadata
    assert "data:image/svg+xml;base64," in result["training_curves"].value
    svg = base64.b64decode(result["training_curves"].value.split("base64,")[1].split(")")[0]).decode()
    assert ET.fromstring(svg).findall("{http://www.w3.org/2000/svg}polyline")
    assert "val centred cosine" in result["verdict"].value
    assert "| best step | 10 |" in result["this_run"].value or "| best step | 20 |" in result["this_run"].value
    # One-run figures are a table, not one-point charts; what changes run to run stays a number.
    assert not any(k.startswith(("host_", "gpu", "hw_", "best_")) for k in result)
    assert isinstance(result["val_centred_cosine"], dg.FloatMetadataValue)
    # TensorBoard: this run's folder, scalars against the step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fingerprint = result["fingerprint"].value
    events = EventAccumulator(str(run_folder(paths.root, load_settings(paths.root).training, fingerprint)))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.step for e in events.Scalars("val/val_centred_cosine")] == [0, 10, 20]
    assert "hardware/host_cpu_pct" in events.Tags()["scalars"]
    assert run_folder(paths.root, load_settings(paths.root).training, fingerprint).name in result["tensorboard"].value


def _flip(path: Path, offset: int = -5) -> None:
    """One bit flipped near the end of the file: inside the tensor data, where safetensors loads it silently."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_skipped_and_the_final_weights_are_identical(shard_sets, reference, tmp_path, caplog):
    first = train(tmp_path, shard_sets, stop_after=13)
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(first.fingerprint)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000005", "step-00000010"]
    _flip(run_dir / "step-00000010" / WEIGHTS_FILE)
    events = []
    with caplog.at_level("WARNING", logger="gguf_assets"):
        train(tmp_path, shard_sets, on_event=events.append)
    assert "checkpoint step-00000010 is damaged" in caplog.text and "content differs" in caplog.text
    assert any(isinstance(e, Note) and "from step-00000005" in e.message for e in events)
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]


def test_damaged_final_weights_are_set_aside_and_trained_again_identically(shard_sets, reference, tmp_path):
    from gguf_assets.lib.project.layout import DAMAGED_FINAL_DIR

    train(tmp_path, shard_sets)
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(reference["summary"].fingerprint)
    _flip(run_dir / FINAL_DIR / WEIGHTS_FILE)
    with pytest.raises(TrainingError, match=r"content differs.*final.damaged.*same weights"):
        load_final(run_dir)  # what the export reads: never a damaged adapter
    assert (run_dir / DAMAGED_FINAL_DIR).is_dir() and not (run_dir / FINAL_DIR).exists()
    events = []
    train(tmp_path, shard_sets, on_event=events.append)
    assert any(isinstance(e, Note) and "resuming" in e.message and "step-00000040" in e.message for e in events)
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]

    _flip(run_dir / FINAL_DIR / WEIGHTS_FILE)  # found by the trainer itself, when the adapter is asked for again
    events.clear()
    train(tmp_path, shard_sets, on_event=events.append)
    assert any(isinstance(e, Note) and e.warning and "are damaged" in e.message for e in events)
    assert load_final(run_dir)[1]["step"] == 40
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]


def test_the_reader_checks_a_shard_against_its_recorded_sha256(tmp_path):
    from gguf_assets.lib.core import verify
    from gguf_assets.lib.training.train_data import ShardCorrupt, load_shard

    (shard,) = write_shards(tmp_path, shards=1, prompts=4, seed=5)
    for half, name in (("teacher", TEACHER_FILE), ("student", STUDENT_FILE)):
        meta = atomic.read_json(shard / f"{half}.json")
        atomic.write_json(shard / f"{half}.json", {**meta, **verify.record(shard / name)})
    assert load_shard(shard).targets.shape[0] == 4
    _flip(shard / TEACHER_FILE)
    with pytest.raises(ShardCorrupt, match=r"teacher.safetensors: its content differs.*computes this half again"):
        load_shard(shard)
    assert not (shard / "teacher.json").exists() and (shard / "student.json").exists()


# -- the weight average (training.ema_decay) ----------------------------------------------

EMA_SETTINGS = replace(SETTINGS, training={"ema_decay": 0.9})


def test_ema_off_leaves_the_fingerprint_and_the_weights_as_before(shard_sets, reference):
    """ema_decay 0 (the default) is the trainer as it was before the setting existed."""
    assert SETTINGS.training.ema_decay == 0.0
    # Pinned at training-run format 3 (ggk's resampler): a new key at its off value must not start new runs, and
    # neither do heads (which follow from the width) nor layer_fusion (one layer left to fuse).
    assert fingerprint_for(SETTINGS, shard_sets) == reference["summary"].fingerprint == "a35b6748e40f9c05"
    assert training_fingerprint(Settings(), ["t0"], ["v0"]) == "0db1004ed8810a5a"
    assert fingerprint_for(replace(SETTINGS, training={"heads": 1, "layer_fusion": "mix"}), shard_sets) == \
        reference["summary"].fingerprint
    assert fingerprint_for(EMA_SETTINGS, shard_sets) != reference["summary"].fingerprint
    # Off, nothing is averaged: final/ holds the last step's raw weights, and checkpoints carry no average.
    run_dir = reference["run_dir"]
    last = list_checkpoints(run_dir)[-1]
    assert last.name == "step-00000040"
    assert reference["weights"] == (last / WEIGHTS_FILE).read_bytes()
    assert "ema" not in torch.load(last / "trainer_state.pt", weights_only=True)


# -- target standardization and the relational term (bench_quality's variants) ------------

def test_each_recipe_variant_key_set_otherwise_is_a_new_run(shard_sets, reference):
    """At their defaults they are left out of the fingerprint (the pinned value above); set, they count."""
    prints = {fingerprint_for(replace(SETTINGS, training=change), shard_sets)
              for change in ({"target_standardization": "isotropic"}, {"relational_weight": 0.5},
                             {"init": "row_means"}, {"query_lr_scale": 10.0})}
    assert len(prints) == 4 and reference["summary"].fingerprint not in prints


def test_isotropic_standardization_scales_every_row_and_dim_by_one_std(shard_sets, reference, tmp_path):
    settings = replace(SETTINGS, training={"target_standardization": "isotropic"})
    summary = train(tmp_path, shard_sets, settings)
    model, _ = load_final(ProjectPaths.of(tmp_path).checkpoints_dir(summary.fingerprint))
    targets = torch.cat([load_file(f / TEACHER_FILE)["targets"].double() for f in shard_sets["train"]])
    # PHI-S's single scale: the root of the mean per-(row, dim) variance, for the loss and the output alike; the
    # centre stays per (row, dim).
    expected = targets.var(0, unbiased=False).mean().sqrt().float()
    assert torch.allclose(model.target_std, expected.expand(TARGET_DIM), rtol=1e-4)
    assert torch.allclose(model.loss_std, expected.expand(QUERY_ROWS, TARGET_DIM), rtol=1e-4)
    assert torch.allclose(model.target_centre, targets.mean(0).float(), atol=1e-4)
    # The default: trainer8's loss scale per (row, dim), and the output's per dim (the rows' mean variance), the
    # one scale a row-shared out_proj can fold.
    default, _ = load_final(reference["run_dir"])
    variance = targets.var(0, unbiased=False)
    assert torch.allclose(default.loss_std, variance.sqrt().float(), rtol=1e-4)
    assert torch.allclose(default.target_std, variance.mean(0).sqrt().float(), rtol=1e-4)
    assert default.loss_std.std() > 0.1 * default.loss_std.mean()  # it really is per (row, dim)
    assert summary.val_centred_cosine > summary.untrained_val_centred_cosine + 0.15, summary


# -- the start at the row means and the query rows' learning rate (#68) ----------------------------------------

def _with_row_means(shape, centre: torch.Tensor, std: torch.Tensor, seed: int = 0):
    from gguf_assets.lib.training.adapter import Adapter, start_at_row_means

    torch.manual_seed(seed)
    model = Adapter(shape)
    model.target_centre.copy_(centre)
    model.target_std.copy_(std)
    start_at_row_means(model, seed=seed)
    return model


def test_the_row_means_start_outputs_each_rows_mean_whatever_the_prompt():
    """training.init: row_means. Untrained, the adapter gives every prompt the train targets' per-row mean, here with
    more rows (Q 96) than the width (64): the row means have rank <= D (16), which the width holds. ggk's function of
    the same weights (the export folds the per-dim standardization into out_proj) gives the same."""
    from gguf_assets.lib.training.adapter import AdapterShape

    g = torch.Generator().manual_seed(5)
    rows, dim = 96, TARGET_DIM
    centre = torch.randn(rows, 4, generator=g) @ torch.randn(4, dim, generator=g) * 3 + torch.randn(dim, generator=g)
    centre = centre + torch.randn(rows, dim, generator=g) * 0.5  # full rank 16, strong per-row means
    std = torch.rand(dim, generator=g) + 0.2
    model = _with_row_means(AdapterShape(student_dim=STUDENT_DIM, query_rows=rows, target_dim=dim, width=64,
                                         depth=2), centre, std).eval()
    assert float(model.query.detach().square().mean().sqrt()) == pytest.approx(0.02, rel=1e-3)  # the usual RMS
    states = torch.randn(3, 7, STUDENT_DIM, generator=g)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    with torch.no_grad():
        out = model.to_target_space(model(states, mask))
        weight, bias = model.folded_out_proj()
        folded = model.ln_out(model.query) @ weight.T + bias
    assert (out - centre).abs().max() < 1e-3 * centre.abs().max()
    assert torch.allclose(folded, centre, atol=1e-3 * float(centre.abs().max()))


def test_the_row_means_start_fits_the_widths_share_of_a_higher_rank():
    """With more row-mean directions than the width holds (rank 80 > W - 2 = 62), the start gives the best the width
    can: what is left is no more than the singular values beyond the 62nd carry."""
    from gguf_assets.lib.training.adapter import AdapterShape

    g = torch.Generator().manual_seed(6)
    rows = dim = 80
    centre = torch.randn(rows, dim, generator=g)
    centre = centre - centre.mean(0)
    model = _with_row_means(AdapterShape(student_dim=STUDENT_DIM, query_rows=rows, target_dim=dim, width=64,
                                         depth=1), centre, torch.ones(dim)).eval()
    with torch.no_grad():
        out = model.to_target_space(model(torch.randn(1, 5, STUDENT_DIM, generator=g), torch.ones(1, 5,
                                                                                                  dtype=torch.bool)))
    left = float((out[0] - centre).square().sum())
    beyond = float(torch.linalg.svdvals(centre.double())[62:].square().sum())
    assert beyond * 0.99 <= left <= beyond * 1.01


def test_a_run_from_the_row_means_starts_at_them_and_learns(shard_sets, reference, tmp_path):
    settings = replace(SETTINGS, training={"init": "row_means"})
    summary = train(tmp_path, shard_sets, settings)
    assert summary.finished and summary.fingerprint != reference["summary"].fingerprint
    # Untrained, each prompt's output is its rows' means: nothing of the prompt, centred cosine about 0.
    assert abs(summary.untrained_val_centred_cosine) < 0.05, summary
    assert summary.val_centred_cosine > summary.untrained_val_centred_cosine + 0.15, summary
    model, _ = load_final(ProjectPaths.of(tmp_path).checkpoints_dir(summary.fingerprint))
    untouched, _ = load_final(reference["run_dir"])
    assert set(model.state_dict()) == set(untouched.state_dict())  # the same tensors: the same file


def test_query_lr_scale_steps_the_query_rows_that_many_times_as_far(shard_sets, tmp_path):
    """Adam's first step moves each weight by about the learning rate, whatever its gradient's size: the query rows
    move query_lr_scale times as far as with 1, every other weight exactly as far. A stop and resume of the run with
    two parameter groups is bit-identical."""
    from gguf_assets.lib.training.train import adapter_shape, build_model

    one_step = {"steps": 1, "warmup_steps": 0, "validate_every": 1, "checkpoint_every": 1}
    start = build_model(adapter_shape(SETTINGS, shard_sets["train"]), seed=SETTINGS.training.seed).state_dict()
    moved = {}
    for scale in (1.0, 10.0):
        settings = replace(SETTINGS, training={**one_step, "query_lr_scale": scale})
        summary = train(tmp_path / str(scale), shard_sets, settings)
        model, _ = load_final(ProjectPaths.of(tmp_path / str(scale)).checkpoints_dir(summary.fingerprint))
        moved[scale] = {k: v - start[k] for k, v in model.state_dict().items()
                        if k not in ("target_centre", "target_std", "loss_std")}
    ratio = moved[10.0]["query"] / moved[1.0]["query"]
    assert torch.allclose(ratio, torch.full_like(ratio, 10.0), rtol=1e-3)
    assert all(torch.equal(moved[10.0][k], moved[1.0][k]) for k in moved[1.0] if k != "query")

    settings = replace(SETTINGS, training={"query_lr_scale": 10.0})
    whole = train(tmp_path / "whole", shard_sets, settings)
    train(tmp_path / "paused", shard_sets, settings, stop_after=13)
    resumed = train(tmp_path / "paused", shard_sets, settings)

    def final_weights(root: Path, summary: TrainedAdapter) -> bytes:
        return (ProjectPaths.of(root).checkpoints_dir(summary.fingerprint) / FINAL_DIR / WEIGHTS_FILE).read_bytes()

    assert final_weights(tmp_path / "paused", resumed) == final_weights(tmp_path / "whole", whole)


def test_relational_loss_measures_the_batchs_similarity_structure():
    from gguf_assets.lib.training.adapter import adapter_loss, relational_loss

    g = torch.Generator().manual_seed(0)
    targets = torch.randn(6, QUERY_ROWS, TARGET_DIM, generator=g)
    assert float(relational_loss(targets, targets)) == pytest.approx(0.0, abs=1e-7)
    # Cosines ignore each prompt's scale; a batch of one has no structure to match.
    scaled = targets * torch.rand(6, 1, 1, generator=g).add(0.5)
    assert float(relational_loss(scaled, targets)) == pytest.approx(0.0, abs=1e-6)
    assert float(relational_loss(targets[:1] * -1, targets[:1])) == pytest.approx(0.0, abs=1e-7)
    shuffled = targets[torch.tensor([1, 0, 3, 2, 5, 4])]
    pred = shuffled.clone().requires_grad_(True)
    term = relational_loss(pred, targets)
    assert float(term.detach()) > 1e-3  # each prompt's own output is right, its place among the others is not
    term.backward()
    assert float(pred.grad.abs().sum()) > 0
    plain = adapter_loss(shuffled, targets, cosine_weight=0.5)
    assert float(adapter_loss(shuffled, targets, cosine_weight=0.5, relational_weight=2.0)) == pytest.approx(
        float(plain) + 2.0 * float(term.detach()), rel=1e-5)


def test_the_adapter_reads_the_prompt_as_a_set_of_states():
    """The adapter adds no positions: word order reaches it only through the student's states, which is why it
    reads the student's final norm (after the student's own attention), as ggk feeds it."""
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape

    torch.manual_seed(0)
    model = Adapter(AdapterShape(student_dim=STUDENT_DIM, query_rows=QUERY_ROWS, target_dim=TARGET_DIM, width=64,
                                 depth=2)).eval()
    states, mask = torch.randn(1, 7, STUDENT_DIM), torch.ones(1, 7, dtype=torch.bool)
    with torch.no_grad():
        out = model(states, mask)
        assert torch.allclose(model(states[:, torch.randperm(7)], mask), out, atol=1e-5)
        assert not torch.allclose(model(states[:, :6], mask[:, :6]), out, atol=1e-3)  # the set itself matters


def test_a_run_with_the_relational_term_learns(shard_sets, reference, tmp_path):
    summary = train(tmp_path, shard_sets, replace(SETTINGS, training={"relational_weight": 0.1}))
    assert summary.finished and summary.fingerprint != reference["summary"].fingerprint
    assert summary.val_centred_cosine > summary.untrained_val_centred_cosine + 0.15, summary


def test_final_and_best_weights_carry_their_validations_input_peaks(shard_sets, reference):
    """The export's f16 check reads the input peaks the validation of the weights recorded in their meta.json: the
    final record is what the final weights give over the val prompts one at a time (as ggk runs them, no padding),
    to float tolerance, and it names the val shards it was measured on."""
    run_dir = reference["run_dir"]
    model, meta = load_final(run_dir)
    recorded = recorded_peaks(meta, shard_sets["val"])
    per_prompt = measure_peaks(model, shard_sets["val"], device=torch.device("cpu"), batch_size=1)
    assert len(per_prompt) == 2 + 10 * SETTINGS.training.depth and recorded.keys() == per_prompt.keys()
    for name, peak in per_prompt.items():
        assert recorded[name] == pytest.approx(peak, rel=1e-5), name
    assert recorded_peaks(atomic.read_json(run_dir / BEST_DIR / META_FILE), shard_sets["val"]) is not None
    assert recorded_peaks(meta, shard_sets["train"]) is None  # not a record of those shards


@pytest.fixture(scope="module")
def ema_reference(shard_sets, tmp_path_factory):
    root = tmp_path_factory.mktemp("ema-reference")
    summary = train(root, shard_sets, EMA_SETTINGS)
    run_dir = ProjectPaths.of(root).checkpoints_dir(summary.fingerprint)
    return {"summary": summary, "run_dir": run_dir, "weights": (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes(),
            "best": (run_dir / BEST_DIR / WEIGHTS_FILE).read_bytes()}


def test_ema_final_holds_the_average_not_the_raw_weights(shard_sets, ema_reference, reference):
    from gguf_assets.lib.training.train import evaluate

    run_dir, summary = ema_reference["run_dir"], ema_reference["summary"]
    last = list_checkpoints(run_dir)[-1]
    assert last.name == "step-00000040"
    raw = load_file(str(last / WEIGHTS_FILE))
    average = torch.load(last / "trainer_state.pt", weights_only=True)["ema"]
    final = load_file(str(run_dir / FINAL_DIR / WEIGHTS_FILE))
    assert set(final) == set(raw) == set(average)
    assert all(torch.equal(final[k], average[k]) for k in final)
    changed = [k for k in final if not torch.equal(final[k], raw[k])]
    assert "query" in changed and "out_proj.weight" in changed
    statistics = [name for name, _ in load_final(run_dir)[0].named_buffers()]
    assert statistics == ["target_centre", "target_std", "loss_std"]
    assert all(torch.equal(final[k], raw[k]) for k in statistics)  # statistics are not averaged
    # The raw weights train exactly as without the average; only what is kept differs.
    assert (last / WEIGHTS_FILE).read_bytes() == reference["weights"]
    # What was reported is the average's score, and the export reads the average.
    model, meta = load_final(run_dir)
    again = evaluate(model, shard_sets["val"], device=torch.device("cpu"),
                     cosine_weight=SETTINGS.training.cosine_weight)
    assert again["val_centred_cosine"] == pytest.approx(summary.val_centred_cosine, abs=1e-6)
    assert meta["training"]["ema_decay"] == 0.9
    assert summary.val_centred_cosine != reference["summary"].val_centred_cosine


def test_ema_stop_and_resume_is_bit_identical(shard_sets, ema_reference, tmp_path):
    first = train(tmp_path, shard_sets, EMA_SETTINGS, stop_after=13)
    assert first.step == 13
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(first.fingerprint)
    assert list_checkpoints(run_dir)[-1].name == "step-00000010"
    summary = train(tmp_path, shard_sets, EMA_SETTINGS)
    assert summary.finished
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == ema_reference["weights"]
    assert (run_dir / BEST_DIR / WEIGHTS_FILE).read_bytes() == ema_reference["best"]
    assert summary.val_centred_cosine == ema_reference["summary"].val_centred_cosine


def test_ema_decay_must_be_below_one():
    from gguf_assets.lib.project.settings import SettingsError, settings_from_dict

    materials = {"teacher": "t", "student": "s"}
    assert settings_from_dict({"materials": materials, "training": {"ema_decay": 0.999}}).training.ema_decay == 0.999
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(SettingsError, match="training.ema_decay"):
            settings_from_dict({"materials": materials, "training": {"ema_decay": bad}})


def test_each_training_line_has_an_eta_that_counts_down(shard_sets, tmp_path, caplog):
    """The console's training lines end with an ETA at this run's rate (checkpoints and validations included)."""
    import re

    with caplog.at_level("INFO", logger="gguf_assets"):
        train(tmp_path, shard_sets)
    lines = [r.getMessage() for r in caplog.records if re.match(r"step \d+/40 loss", r.getMessage())]
    # Step 1 is shown at once (training has started), then every log_every steps.
    assert len(lines) == 1 + 40 // SETTINGS.training.log_every and lines[0].startswith("step 1/40 loss"), lines
    # Step 1 gives no ETA: one step's time (its warm-up included) made the demo's 2 minutes read as 38.
    assert not re.search(r", ETA \S+$", lines[0]) and "the rate and ETA" in lines[0], lines[0]
    etas = [re.search(r", ETA (\S+)$", line).group(1) for line in lines[1:]]
    assert etas[-1] == "0s"  # the last step: nothing left
    assert all(re.fullmatch(r"(\d+m)?\d+s", eta) for eta in etas), etas


def test_precision_auto_is_bf16_autocast_where_the_cpu_computes_bf16_and_a_speed_setting(shard_sets, reference,
                                                                                          tmp_path, caplog):
    """training.precision: "auto" (the default) runs the steps under bf16 autocast on a CPU with bf16 hardware when
    a step is large enough to gain from it, in f32 elsewhere; "fp32" and "bf16" choose. Like the device, it changes
    speed and rounding, not the run: the fingerprint stays, and the runs score alike."""
    from gguf_assets.lib.training.precision import (
        CPU_BF16_FEATURES,
        CPU_BF16_MIN_WORK,
        describe,
        native_bf16,
        step_precision,
    )

    cpu = torch.device("cpu")
    has_bf16 = any(torch.cpu.get_capabilities().get(feature) for feature in CPU_BF16_FEATURES)
    assert (native_bf16(cpu) is not None) == has_bf16
    assert step_precision("auto", cpu, work=CPU_BF16_MIN_WORK) == ("bf16" if has_bf16 else "fp32")
    assert step_precision("auto", cpu, work=CPU_BF16_MIN_WORK - 1) == "fp32"  # the casts would cost more
    assert describe("auto", cpu, work=1000) == "training steps run in f32 (" + (
        "a step this small runs faster in f32 on a CPU: prompts x query rows x width = 1,000, below 262,144)"
        if has_bf16 else "cpu has no bf16 hardware)")
    assert describe("fp32", cpu, work=CPU_BF16_MIN_WORK) == "training steps run in f32 (training.precision: fp32)"
    for work in (1, CPU_BF16_MIN_WORK):
        assert (step_precision("fp32", cpu, work=work), step_precision("bf16", cpu, work=work)) == ("fp32", "bf16")
    for precision in ("fp32", "bf16"):
        assert fingerprint_for(replace(SETTINGS, training={"precision": precision}), shard_sets) == \
            reference["summary"].fingerprint
    # The suite's tiny adapter (8 query rows x 8 prompts x 64 wide) is a small step: auto trained it in f32.
    _, auto_meta = load_final(reference["run_dir"])
    assert auto_meta["precision"] == "fp32"

    with caplog.at_level("INFO", logger="gguf_assets"):
        forced = train(tmp_path, shard_sets, replace(SETTINGS, training={"precision": "bf16"}))
    assert "training steps run under bf16 autocast (" in caplog.text
    assert ("avx512_bf16 computes bf16" in caplog.text or "amx_bf16 computes bf16" in caplog.text or
            "emulated: slower than f32" in caplog.text), caplog.text
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(forced.fingerprint)
    assert load_final(run_dir)[1]["precision"] == "bf16"
    # The steps' rounding differs, so the weights do; the score barely.
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() != reference["weights"]
    assert abs(forced.val_centred_cosine - reference["summary"].val_centred_cosine) < 0.02


def test_a_torch_without_the_cpu_capability_reader_trains_in_f32_as_before(monkeypatch):
    """pyproject admits torch 2.4, before torch.cpu.get_capabilities: there "auto" keeps the CPU in f32."""
    from gguf_assets.lib.training.precision import native_bf16, step_precision

    monkeypatch.delattr(torch.cpu, "get_capabilities")
    cpu = torch.device("cpu")
    assert native_bf16(cpu) is None and step_precision("auto", cpu, work=1 << 30) == "fp32"


def test_tensorboard_names_a_run_by_its_shape_and_keeps_an_unnamed_runs_curves(tmp_path):
    """Runs are named width x depth, steps and lr (plus the fingerprint's start), not by a bare hex
    fingerprint; a folder from before names existed becomes the named one, so no curve is lost."""
    from gguf_assets.lib.telemetry.curves_log import run_name

    fingerprint = "0123456789abcdef"
    assert run_name(SETTINGS.training, fingerprint) == "64x1-40steps-lr0.003-01234567"
    old = tmp_path / "tensorboard" / fingerprint
    old.mkdir(parents=True)
    (old / "events.out.tfevents.1").write_bytes(b"kept")
    folder = run_folder(tmp_path, SETTINGS.training, fingerprint)
    assert folder.name == "64x1-40steps-lr0.003-01234567" and not old.exists()
    assert (folder / "events.out.tfevents.1").read_bytes() == b"kept"


def test_a_stop_between_checkpoints_keeps_its_steps_and_resumes_bit_identical(shard_sets, reference, tmp_path):
    """Ctrl-C at step 7 (checkpoints every 5): the stop waits for the step to be whole, writes a checkpoint of
    step 7 before the run ends, and the next run continues from step 7 to the uninterrupted run's weights."""
    import os
    import signal

    settings = replace(SETTINGS, training={"log_every": 1})  # not a result setting: same fingerprint

    def ctrl_c_at_step_7(event):
        if isinstance(event, LogStep) and event.step == 7:
            os.kill(os.getpid(), signal.SIGINT)  # a real signal, mid-step: held until the step is done

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (xdist may differ)
    try:
        events = []
        with pytest.raises(KeyboardInterrupt):
            train(tmp_path, shard_sets, settings, on_event=lambda e: (events.append(e), ctrl_c_at_step_7(e)))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [e.step for e in events if isinstance(e, LogStep)][-1] == 7  # nothing ran past the stop
    run_dir = ProjectPaths.of(tmp_path).checkpoints_dir(reference["summary"].fingerprint)
    assert list_checkpoints(run_dir)[-1].name == "step-00000007"
    assert any(isinstance(e, Note) and "stopped at step 7 of 40: checkpoint written" in e.message for e in events)
    events.clear()
    train(tmp_path, shard_sets, settings, on_event=events.append)
    assert any(isinstance(e, Note) and "step-00000007" in e.message for e in events)
    assert [e.step for e in events if isinstance(e, LogStep)][0] == 8  # no step done twice
    assert (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes() == reference["weights"]


def _streamed_target_stats(folders: list[Path], *, sigma_floor: float, isotropic: bool = False):
    """target_stats as it was before the per-shard sums: every target streamed in chunks, in shard order.
    Returns (centre [Q, D], output std [D], loss std [Q, D], prompts)."""
    from gguf_assets.lib.precompute.target_sums import STATS_CHUNK_PROMPTS

    total, s1, s2 = 0, None, None
    for folder in folders:
        targets = load_file(str(folder / TEACHER_FILE))["targets"]
        for begin in range(0, targets.shape[0], STATS_CHUNK_PROMPTS):
            chunk = targets[begin:begin + STATS_CHUNK_PROMPTS].double()
            s1 = chunk.sum(0) if s1 is None else s1 + chunk.sum(0)
            s2 = (chunk * chunk).sum(0) if s2 is None else s2 + (chunk * chunk).sum(0)
            total += chunk.shape[0]
    mean = s1 / total
    var = (s2 / total - mean * mean).clamp_min(0)
    if isotropic:
        one = var.mean().sqrt().clamp_min(sigma_floor).float()
        return mean.float(), one.expand(var.shape[1]).contiguous(), one.expand_as(var).contiguous(), total
    return (mean.float(), var.mean(0).sqrt().clamp_min(sigma_floor).float(), var.sqrt().clamp_min(sigma_floor).float(),
            total)


def _fields(stats) -> tuple:
    return stats.centre, stats.output_std, stats.loss_std, stats.prompts


def _same_stats(got, want) -> bool:
    return got[3] == want[3] and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))


def test_cached_shard_sums_give_the_streamed_statistics_bit_for_bit(tmp_path, monkeypatch):
    """The per-shard chunk sums (stored beside each teacher half) fold to exactly the streamed statistics, on the
    first run (computed) and the next (reused without reading the targets); a changed half or a damaged sums file
    is never reused."""
    from gguf_assets.lib.core import verify
    from gguf_assets.lib.precompute import target_sums
    from gguf_assets.lib.training import train_data

    # 70 and 33 prompts: chunks of 32 that straddle nothing and chunks with a remainder.
    folders = write_shards(tmp_path / "a", shards=3, prompts=70, seed=5) + write_shards(tmp_path / "b", shards=2,
                                                                                      prompts=33, seed=6)
    for folder in folders:  # recorded as the precompute records them, so the sums may be stored
        record = atomic.read_json(folder / "teacher.json")
        atomic.write_json(folder / "teacher.json", {**record, **verify.record(folder / TEACHER_FILE)})

    def same(isotropic: bool) -> None:
        got = _fields(train_data.target_stats(folders, sigma_floor=0.05, isotropic=isotropic))
        want = _streamed_target_stats(folders, sigma_floor=0.05, isotropic=isotropic)
        assert got[3] == want[3] == 3 * 70 + 2 * 33
        assert _same_stats(got, want)

    same(False)
    assert all((f / target_sums.STATS_FILE).is_file() and (f / target_sums.STATS_RECORD).is_file() for f in folders)
    real_read_half = train_data.read_half

    def no_teacher_reads(folder, half, **kwargs):
        raise AssertionError(f"read {folder} {half}: the stored sums should have been reused")

    monkeypatch.setattr(train_data, "read_half", no_teacher_reads)
    same(False)
    same(True)

    # A teacher half written again with other targets (and its new record): its sums are computed again.
    changed = folders[1]
    save_file({"targets": (load_file(str(changed / TEACHER_FILE))["targets"].float() * 2).half()},
              str(changed / TEACHER_FILE))
    atomic.write_json(changed / "teacher.json", {**atomic.read_json(changed / "teacher.json"),
                                                 **verify.record(changed / TEACHER_FILE)})
    reads = []
    monkeypatch.setattr(train_data, "read_half", lambda folder, half, **kw: reads.append(folder)
                        or real_read_half(folder, half, **kw))
    same(False)
    assert reads == [changed]

    # Damaged sums (a flipped byte): not trusted, computed again from the half, and stored again whole.
    _flip(folders[3] / target_sums.STATS_FILE)
    reads.clear()
    same(False)
    assert reads == [folders[3]]
    reads.clear()
    same(False)
    assert reads == []


def test_sums_stored_by_the_precompute_are_the_sums_of_the_written_half(tmp_path, monkeypatch):
    """_write_half stores a teacher half's sums from the targets in memory: training then reads no teacher byte
    before its first step, and gets the streamed statistics bit for bit. Non-finite targets store nothing (training
    names the prompt, as before)."""
    from gguf_assets.lib.precompute import target_sums
    from gguf_assets.lib.precompute.shards import _write_half
    from gguf_assets.lib.training import train_data

    source = write_shards(tmp_path / "src", shards=2, prompts=45, seed=7)
    folders = []
    for k, folder in enumerate(source):
        out = tmp_path / "written" / f"{k:05d}"
        out.mkdir(parents=True)
        _write_half(out, "teacher", {"targets": load_file(str(folder / TEACHER_FILE))["targets"]},
                    {"fingerprint": f"t-{k}", "prompts": 45})
        assert (out / target_sums.STATS_RECORD).is_file()
        folders.append(out)
    monkeypatch.setattr(train_data, "read_half", lambda folder, half, **kw: pytest.fail(f"read {folder} {half}"))
    got = _fields(train_data.target_stats(folders, sigma_floor=0.05))
    want = _streamed_target_stats(source, sigma_floor=0.05)
    assert got[3] == want[3] == 90 and _same_stats(got, want)

    bad = tmp_path / "bad"
    bad.mkdir()
    targets = torch.zeros(3, QUERY_ROWS, TARGET_DIM).half()
    targets[1, 0, 0] = float("nan")
    _write_half(bad, "teacher", {"targets": targets}, {"fingerprint": "t-bad", "prompts": 3})
    assert not (bad / target_sums.STATS_RECORD).exists()


# -- the adapter is ggk's seedless resampler ------------------------------------------------

def _random_adapter(**shape) -> "torch.nn.Module":
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape

    torch.manual_seed(1)
    model = Adapter(AdapterShape(**{"student_dim": STUDENT_DIM, "query_rows": QUERY_ROWS, "target_dim": TARGET_DIM,
                                    "width": 128, "depth": 2, **shape})).eval()
    with torch.no_grad():
        model.target_centre.normal_().mul_(3)
        model.target_std.uniform_(0.5, 2.0)
        model.loss_std.uniform_(0.5, 2.0)
    return model


def test_the_adapter_is_ggks_resampler_tensor_for_tensor():
    """Its state dict is ggk's tensor list (gguf_format's, the file's ``adapter.`` prefix aside) plus the training
    statistics; heads are width / 64, never set; another width or variant is refused."""
    from gguf_assets.lib.output.gguf_format import TRAINING_ONLY, expected_tensor_shapes, hparams_of
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape

    model = _random_adapter()
    shape = model.shape
    assert shape.heads == 2 and model.blocks[0].self_attn.heads == model.blocks[0].cross_attn.heads == 2
    assert list(shape.to_dict()) == ["student_dim", "query_rows", "target_dim", "width", "depth", "variant"]
    assert shape.variant == "resampler"
    expected = expected_tensor_shapes(hparams_of(student_dim=STUDENT_DIM, query_rows=QUERY_ROWS,
                                                 target_dim=TARGET_DIM, width=128, depth=2))
    state = model.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items() if k not in TRAINING_ONLY} == expected
    assert [k for k in state if k in TRAINING_ONLY] == ["target_centre", "target_std", "loss_std"]
    assert isinstance(model.blocks[0].mlp[1], torch.nn.GELU) and model.blocks[0].mlp[1].approximate == "none"
    assert all(m.eps == 1e-5 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    for bad in (dict(width=100), dict(width=32), dict(variant="seeded")):
        with pytest.raises(ValueError, match="multiple of ggk's head dim 64|variant"):
            Adapter(AdapterShape(**{**shape.to_dict(), **bad}))


def test_the_folded_out_proj_gives_the_targets_the_checkpoint_predicts():
    """What the export writes (the per-dim scale and mean folded into out_proj) computes to_target_space of the
    standardized output: ggk's file needs no statistics of its own."""
    model = _random_adapter()
    states, mask = torch.randn(3, 9, STUDENT_DIM), torch.ones(3, 9, dtype=torch.bool)
    weight, bias = model.folded_out_proj()
    with torch.no_grad():
        want = model.to_target_space(model(states, mask))
        q = model.query.expand(3, -1, -1)
        kv = model.in_proj(states)
        for block in model.blocks:
            q = block(q, kv, mask)
        got = model.ln_out(q) @ weight.T + bias
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    assert torch.allclose(model.target_mean, model.target_centre.mean(0))


def test_a_padded_batch_is_each_prompt_alone_as_ggk_runs_it():
    """ggk runs one prompt with no key mask; a training batch masks its padding keys, the same function."""
    model = _random_adapter()
    lengths = [9, 4, 1]
    states = torch.randn(len(lengths), max(lengths), STUDENT_DIM)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        batched = model(states, mask)
        for i, n in enumerate(lengths):
            alone = model(states[i:i + 1, :n], torch.ones(1, n, dtype=torch.bool))
            assert torch.allclose(batched[i], alone[0], atol=1e-5), n


def test_rows_shared_by_the_batch_and_checkpointed_blocks_train_as_rows_copied_per_prompt():
    """The first block reads the query rows once per batch (they are the same for every prompt until the first
    cross-attention); with training.grad_checkpoint each block is recomputed in backward. Both give the loss and
    every gradient of the rows copied per prompt, the plain forward, padding and all."""
    from gguf_assets.lib.training.adapter import adapter_loss

    lengths = [9, 4, 1]
    g = torch.Generator().manual_seed(3)
    states = torch.randn(len(lengths), max(lengths), STUDENT_DIM, generator=g)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    targets = torch.randn(len(lengths), QUERY_ROWS, TARGET_DIM, generator=g)

    def copied_per_prompt(model, states, mask):
        kv = model.in_proj(states)
        q = model.query.expand(states.shape[0], -1, -1)
        for block in model.blocks:
            q = block(q, kv, mask)
        return model.out_proj(model.ln_out(q))

    def loss_and_grads(forward, model):
        model.train()
        model.zero_grad()
        loss = adapter_loss(forward(model, states, mask), targets, cosine_weight=0.5)
        loss.backward()
        return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}

    reference_loss, reference = loss_and_grads(copied_per_prompt, _random_adapter())
    for checkpointed in (False, True):
        model = _random_adapter()
        model.grad_checkpoint = checkpointed
        loss, grads = loss_and_grads(lambda m, s, k: m(s, k), model)
        assert loss == pytest.approx(reference_loss, rel=1e-6), checkpointed
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, reference[name], atol=1e-6, rtol=1e-5), (checkpointed, name)
    assert reference["query"].abs().sum() > 0  # the shared rows' gradient sums over the prompts, as the copies' did


def test_the_loss_and_the_score_are_centred_on_each_rows_train_mean():
    """The loss reads trainer8's space (each (row, dim) centred on its train mean, scaled by its own std); the
    score is the centred cosine on the same centre, in teacher space."""
    import torch.nn.functional as F

    from gguf_assets.lib.training.adapter import adapter_loss, centred_cosine_rows

    model = _random_adapter()
    g = torch.Generator().manual_seed(2)
    pred = torch.randn(4, QUERY_ROWS, TARGET_DIM, generator=g)
    in_target_space = model.to_target_space(pred)
    assert torch.allclose(model.loss_space(pred), (in_target_space - model.target_centre) / model.loss_std)
    assert torch.allclose(model.loss_targets(in_target_space), model.loss_space(pred), atol=1e-5)
    # A perfect prediction costs nothing; the cosine term reads each row's variation, not its constant part.
    perfect = adapter_loss(model.loss_space(pred), model.loss_targets(in_target_space), cosine_weight=0.5)
    assert float(perfect) == pytest.approx(0.0, abs=1e-6)
    targets = in_target_space + torch.randn(4, QUERY_ROWS, TARGET_DIM, generator=g)
    score = centred_cosine_rows(pred, targets, model)
    want = F.cosine_similarity(in_target_space - model.target_centre, targets - model.target_centre, dim=-1).mean(-1)
    assert score.shape == (4,) and torch.allclose(score, want, atol=1e-6)
    assert torch.allclose(centred_cosine_rows(pred, in_target_space, model), torch.ones(4), atol=1e-5)
