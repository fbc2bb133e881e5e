"""Shards at the library level, on a small real demo project (real teacher and student models):
memoization per half, corruption and staleness, modes, live figures and hardware sampling."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_assets.lib.core import atomic
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
from gguf_assets.lib.demo.demo import TEACHER_LAYERS
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.precompute.shards import ShardBuilder, build_shards, precompute_split
from gguf_assets.lib.precompute.shards_run import HALVES, ShardError, plan_shards, require_current, shard_status
from gguf_assets.lib.precompute.teacher import PrecomputeOutOfMemory
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.telemetry.hardware import HardwareSampler, NvmlReader
from gguf_assets.lib.telemetry.progress import Progress, format_seconds

SHARD = 6
TRAIN = 2 * SHARD
QUERY_ROWS = 16  # the demo teacher's first 16 of 256 query rows: same code paths, a tenth of the compute


def _prepare(paths, settings):
    materials = resolve_materials(paths, settings)
    build_corpus(paths, settings, materials, fingerprint=corpus_fingerprint(paths, settings, materials))
    return materials


@pytest.fixture
def project(make_project):
    """(paths, settings, materials) of a demo project with 2 train shards of 6 prompts."""
    paths = make_project(corpus={"train_prompts": TRAIN, "val_prompts": 4},
                         precompute={"shard_size": SHARD, "val_shard_size": 4, "teacher_batch": 4,
                                     "token_budget": 4 * 80, "student_batch": 4})
    settings = load_settings(paths.root)
    rows_file = paths.root / settings.materials.teacher / settings.materials.query_rows_file
    rows = load_file(str(rows_file))
    save_file({name: t[:QUERY_ROWS].contiguous() for name, t in rows.items()}, str(rows_file))
    return paths, settings, _prepare(paths, settings)


def _keys(paths, settings, materials, split="train"):
    return [p.key for p in plan_shards(paths, settings, materials, split)]


def _digests(paths, half):
    return {f.parent.name: (atomic.sha256_file(f), f.stat().st_mtime_ns)
            for f in sorted((paths.root / "shards" / "train").glob(f"*/{half}.safetensors"))}


def _with(paths, settings, **changes):
    """Write changed settings to the project and return them with the re-resolved materials."""
    settings = replace(settings, **changes)
    write_project_file(paths.root, settings)
    return settings, resolve_materials(paths, settings)


def test_build_writes_verified_halves_and_reports_live_figures(project, caplog):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    assert len(keys) == 2
    finished, ticks = [], []
    with caplog.at_level(logging.INFO, logger="gguf_assets"):
        run = precompute_split(paths, settings, materials, "train", keys, on_shard_done=finished.append,
                               on_progress=ticks.append, sample_interval_s=0.05)
    # Live figures with each progress line: which shard and half, the rate, and a hardware sample.
    assert {(t["shard"], t["half"]) for t in ticks} >= {(keys[-1], "teacher"), (keys[-1], "student")}
    assert all(t["total"] == TRAIN and "host_cpu_pct" in t and "host_ram_used_gib" in t for t in ticks)
    assert [r.halves["teacher"].tokens > 0 and r.halves["student"].tokens > 0 for r in finished] == [True, True]
    # Each shard is reported the moment it is written, in order (Dagster records it then).
    assert [r.key for r in finished] == keys and run.reports == finished
    for plan in plan_shards(paths, settings, materials, "train"):
        assert shard_status(paths, settings, plan) == {"teacher": "current", "student": "current"}
        folder = plan.folder(paths)
        targets = load_file(str(folder / "teacher.safetensors"))["targets"]
        assert targets.shape == (SHARD, QUERY_ROWS, 64) and targets.dtype == torch.float16
        student = load_file(str(folder / "student.safetensors"))
        assert student["offsets"].shape == (SHARD + 1,) and int(student["offsets"][-1]) == student["hidden"].shape[0]
        assert student["hidden"].dtype == torch.bfloat16 and student["token_ids"].shape == student["hidden"].shape[:1]
        meta = atomic.read_json(folder / "teacher.json")
        assert meta["sha256"] == atomic.sha256_file(folder / "teacher.safetensors")
        assert meta["placement"] == {"cpu": {"layers": TEACHER_LAYERS, "gib": meta["placement"]["cpu"]["gib"]}}
        assert meta["truncated"] == 0 and meta["text_tokens"] > 0
        # Which device computed it, and when it was busy (what the measured rate and ETA are made of).
        assert meta["device"] == "cpu" and meta["started_at"] <= meta["finished_at"]
    report = run.reports[0]
    assert report.halves["teacher"].status == "missing" and report.halves["teacher"].prompts_per_s > 0
    assert report.device_map == {"cpu": {"layers": TEACHER_LAYERS, "gib": report.device_map["cpu"]["gib"]}}
    # Its flat figures, as the shard's Dagster materialization records them (the keys of every version).
    figures = report.figures()
    assert list(figures) == ["split", "key", "prompts", "device", "teacher_status", "teacher_placement",
                             "teacher_cpu_layers", "teacher_cpu_gib", "teacher_seconds", "teacher_truncated",
                             "teacher_tokens",
                             "teacher_prompts_per_s", "student_status", "student_seconds", "student_truncated",
                             "student_tokens", "student_prompts_per_s", *report.hardware]
    assert list(report.hardware)[0] == "hw_samples"
    assert figures["teacher_status"] == "missing" and type(figures["teacher_status"]) is str
    assert figures["teacher_cpu_layers"] == TEACHER_LAYERS and figures["host_process_rss_gib_max"] > 0
    assert figures["device"] == "cpu"
    summary = run.metadata()
    assert run.computed("teacher") == 2 and run.halves["student"].computed == 2
    assert summary["teacher_halves_computed"] == 2 and summary["student_halves_computed"] == 2
    assert summary["teacher_prompts_per_s"] > 0 and summary["teacher_tokens_per_s"] > 0
    assert summary["hw_samples"] >= 3 and "host_cpu_pct_mean" in summary and "host_ram_used_gib_max" in summary
    assert not any(k.startswith("gpu") for k in summary)  # no NVIDIA here: no GPU figures, no failure
    assert f"train teacher: {TRAIN}/{TRAIN} prompts (100%)" in caplog.text
    assert "prompts/s" in caplog.text and "tokens/s" in caplog.text and "ETA" in caplog.text

    # Nothing changed: nothing is recomputed, and the reused work does not count as throughput.
    again = precompute_split(paths, settings, materials, "train", keys)
    assert {r.halves["teacher"].status for r in again.reports} == {"current"}
    assert again.computed("teacher") == 0 and again.halves["teacher"].prompts_per_s == 0


def test_student_change_leaves_teacher_targets_byte_for_byte(project):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    build_shards(paths, settings, materials, "train", keys)
    teacher_before, student_before = _digests(paths, "teacher"), _digests(paths, "student")

    settings, materials = _with(paths, settings, precompute={"student_dtype": "f16"})
    plans = plan_shards(paths, settings, materials, "train")
    assert {h: s for p in plans for h, s in shard_status(paths, settings, p).items()} == {
        "teacher": "current", "student": "stale"}
    reports = build_shards(paths, settings, materials, "train", keys)
    assert {(r.halves["teacher"].status, r.halves["student"].status) for r in reports} == {("current", "stale")}
    assert _digests(paths, "teacher") == teacher_before  # same bytes, never rewritten (same mtime)
    after = _digests(paths, "student")
    assert all(after[k][0] != student_before[k][0] for k in after)
    assert all(load_file(str(p.folder(paths) / "student.safetensors"))["hidden"].dtype == torch.float16 for p in plans)


def test_the_student_half_holds_the_final_norm_states_of_ggks_token_ids(project):
    """Each prompt's rows are the student's final-norm states over the ids ggk feeds it: ggk's LLaDA-Image
    template, each piece tokenized on its own by the port of ggk's tokenizer (not the prompt alone, not the HF
    tokenizer's split of the whole string)."""
    from transformers import AutoModel

    from gguf_assets.lib.core.ggk_contract import llada_image_pieces, rendered_prompt
    from gguf_assets.lib.materials.ggk_tokenizer import GgkTokenizer
    from gguf_assets.lib.precompute.shards_run import half_settings
    from gguf_assets.lib.precompute.student import ggk_token_ids

    paths, settings, materials = project
    build_shards(paths, settings, materials, "train", _keys(paths, settings, materials))
    folder = Path(materials.student["path"])
    tokenizer = GgkTokenizer.of_folder(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for plan in plan_shards(paths, settings, materials, "train"):
        shard = plan.folder(paths)
        student = load_file(str(shard / "student.safetensors"))
        meta = atomic.read_json(shard / "student.json")
        assert meta["dim"] == model.config.hidden_size == student["hidden"].shape[1] and "layers" not in meta
        offsets = student["offsets"].tolist()
        for i, text in enumerate(plan.prompts):
            ids = ggk_token_ids(tokenizer, text)
            assert ids == [t for p in llada_image_pieces(text) for t in tokenizer.encode(p.text)]
            assert len(ids) > len(tokenizer.encode(text))  # the template's tokens are there, before and after
            assert student["token_ids"][offsets[i]:offsets[i + 1]].tolist() == ids, text
            with torch.no_grad():
                expected = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # after the final norm
            got = student["hidden"][offsets[i]:offsets[i + 1]].float()
            assert torch.allclose(got, expected.bfloat16().float(), atol=0.05, rtol=0.02), text
    # The empty prompt is the template's own tokens: the adapter always has keys to attend to.
    assert ggk_token_ids(tokenizer, "") == tokenizer.encode(rendered_prompt(""))
    # The student half is made from ggk's conditioning and the dtype: no layer, no template of the product's.
    assert half_settings("student", settings) == {"conditioning": "llada-image", "dtype": "bf16"}


def test_corrupted_halves_are_detected_never_used_and_recomputed(project, caplog):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    build_shards(paths, settings, materials, "train", keys)
    plans = plan_shards(paths, settings, materials, "train")
    teacher_file = plans[0].folder(paths) / "teacher.safetensors"
    student_file = plans[1].folder(paths) / "student.safetensors"
    good = {f: f.read_bytes() for f in (teacher_file, student_file)}

    flipped = bytearray(good[teacher_file])
    flipped[len(flipped) // 2] ^= 0x01  # one data bit: safetensors itself would load this silently
    teacher_file.write_bytes(bytes(flipped))
    student_file.write_bytes(good[student_file][:-100])  # a truncated file
    assert shard_status(paths, settings, plans[0]) == {"teacher": "corrupt", "student": "current"}
    assert shard_status(paths, settings, plans[1]) == {"teacher": "current", "student": "corrupt"}
    with pytest.raises(ShardError, match=r"00000 teacher half is corrupt; 00001 student half is corrupt.*train_shards"):
        require_current(paths, settings, materials, "train")

    with caplog.at_level(logging.WARNING, logger="gguf_assets.lib.precompute.shards"):
        reports = build_shards(paths, settings, materials, "train", keys)
    assert "00000: teacher half failed verification; recomputing it" in caplog.text
    assert [(r.halves["teacher"].status, r.halves["student"].status) for r in reports] == [("corrupt", "current"),
                                                                             ("current", "corrupt")]
    # Recomputed from scratch, deterministically: the original bytes are back.
    assert {f: f.read_bytes() for f in good} == good
    assert require_current(paths, settings, materials, "train") == [p.folder(paths) for p in plans]


def test_status_reads_no_shard_bytes_and_a_copy_is_hashed_once(project, monkeypatch):
    """The planner and `status` check halves by size, mtime and inode; a copied project (new
    inodes) is confirmed by content once, and its new stamps are kept."""
    import shutil

    paths, settings, materials = project
    build_shards(paths, settings, materials, "train", _keys(paths, settings, materials))
    plans = plan_shards(paths, settings, materials, "train")
    real_sha256 = atomic.sha256_file
    hashed = []

    def counting_sha256(path, **kwargs):
        hashed.append(path.name)
        return real_sha256(path, **kwargs)

    monkeypatch.setattr(atomic, "sha256_file", counting_sha256)
    assert all(shard_status(paths, settings, p) == {"teacher": "current", "student": "current"} for p in plans)
    assert hashed == [], "status hashed shard files whose stamps are as recorded"

    shards = paths.root / "shards" / "train"
    shutil.copytree(shards, shards.with_name("copied"), copy_function=shutil.copy2)
    shutil.rmtree(shards)
    shards.with_name("copied").rename(shards)  # same bytes and mtimes, new inodes
    assert all(set(shard_status(paths, settings, p).values()) == {"current"} for p in plans)
    assert sorted(hashed) == sorted(["teacher.safetensors", "student.safetensors"] * len(plans))
    hashed.clear()
    assert all(set(shard_status(paths, settings, p).values()) == {"current"} for p in plans)
    assert hashed == [], "the confirmed stamps were not kept"


def test_a_change_that_keeps_the_stamp_is_caught_when_training_reads_it(project):
    """Bit rot with the mtime unchanged passes the cheap check; training's read catches it, trains
    on nothing, and drops the half's record, so the next run computes exactly that half again."""
    import os

    from gguf_assets.lib.training.train_data import ShardCorrupt, load_shard

    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    build_shards(paths, settings, materials, "train", keys)
    plan = plan_shards(paths, settings, materials, "train")[1]
    data = plan.folder(paths) / "student.safetensors"
    good, before = data.read_bytes(), data.stat()
    flipped = bytearray(good)
    flipped[-3] ^= 0x01
    with open(data, "r+b") as fh:
        fh.write(flipped)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard_status(paths, settings, plan)["student"] == "current"
    with pytest.raises(ShardCorrupt, match="student.safetensors: its content differs"):
        load_shard(plan.folder(paths))
    assert shard_status(paths, settings, plan) == {"teacher": "current", "student": "missing"}
    reports = build_shards(paths, settings, materials, "train", keys)
    assert [(r.halves["teacher"].status, r.halves["student"].status) for r in reports] == [("current", "current"),
                                                                             ("current", "missing")]
    assert data.read_bytes() == good


def test_a_failed_recompute_leaves_the_half_missing_not_current(project, monkeypatch):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)[:1]
    build_shards(paths, settings, materials, "train", keys)
    plan = plan_shards(paths, settings, materials, "train")[0]
    data = plan.folder(paths) / "teacher.safetensors"
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))

    def out_of_host_memory(self, prompts, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr("gguf_assets.lib.precompute.teacher.HFTeacher.encode", out_of_host_memory)
    with pytest.raises(PrecomputeOutOfMemory, match=r"precompute.token_budget \(now 320\).*precompute.teacher_batch"):
        build_shards(paths, settings, materials, "train", keys)
    assert shard_status(paths, settings, plan)["teacher"] == "missing"


def test_student_out_of_memory_names_the_student_settings(project, monkeypatch):
    paths, settings, materials = project
    settings, materials = _with(paths, settings, precompute={"mode": "student"})

    def out_of_host_memory(self, prompts, **kwargs):
        raise MemoryError()
    monkeypatch.setattr("gguf_assets.lib.precompute.student.Student.encode", out_of_host_memory)
    with pytest.raises(PrecomputeOutOfMemory,
                       match=r"the student ran out of memory on cpu: .*precompute.student_batch \(now 4\)"):
        build_shards(paths, settings, materials, "train", _keys(paths, settings, materials)[:1])


def test_a_changed_setting_makes_only_its_half_stale(project):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    build_shards(paths, settings, materials, "train", keys)
    student_before = _digests(paths, "student")
    settings, materials = _with(paths, settings, precompute={"target_dtype": "bf16", "teacher_batch": 2})
    plan = plan_shards(paths, settings, materials, "train")[0]
    assert shard_status(paths, settings, plan) == {"teacher": "stale", "student": "current"}
    reports = build_shards(paths, settings, materials, "train", keys)
    assert {(r.halves["teacher"].status, r.halves["student"].status) for r in reports} == {("stale", "current")}
    assert load_file(str(plan.folder(paths) / "teacher.safetensors"))["targets"].dtype == torch.bfloat16
    assert _digests(paths, "student") == student_before


def test_teacher_only_then_student_only_then_both(project):
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    folders = [p.folder(paths) for p in plan_shards(paths, settings, materials, "train")]

    settings, materials = _with(paths, settings, precompute={"mode": "teacher"})
    reports = build_shards(paths, settings, materials, "train", keys)
    assert all("student" not in r.halves for r in reports)
    assert all((f / "teacher.safetensors").is_file() and not (f / "student.safetensors").exists() for f in folders)
    teacher_before = _digests(paths, "teacher")

    settings, materials = _with(paths, settings, precompute={"mode": "student"})
    reports = build_shards(paths, settings, materials, "train", keys)
    assert all("teacher" not in r.halves and r.halves["student"].status == "missing" for r in reports)
    assert all((f / "student.safetensors").is_file() for f in folders)

    settings, materials = _with(paths, settings, precompute={"mode": "teacher+student"})
    reports = build_shards(paths, settings, materials, "train", keys)
    assert {(r.halves["teacher"].status, r.halves["student"].status) for r in reports} == {("current", "current")}
    assert _digests(paths, "teacher") == teacher_before


def test_peak_memory_is_one_shard_not_the_corpus(project, monkeypatch):
    """The models only ever see one shard's prompts, and each shard is on disk before the next starts."""
    paths, settings, materials = project
    keys = _keys(paths, settings, materials)
    calls = []
    real_targets = ShardBuilder.targets

    def spy(self, prompts, **kwargs):
        written = sorted(p.parent.name for p in (paths.root / "shards" / "train").glob("*/teacher.json"))
        calls.append((len(prompts), written))
        return real_targets(self, prompts, **kwargs)
    monkeypatch.setattr(ShardBuilder, "targets", spy)
    build_shards(paths, settings, materials, "train", keys)
    assert [n for n, _ in calls] == [SHARD] * 2
    assert [w for _, w in calls] == [[], keys[:1]]


def test_unknown_shards_are_refused(project):
    paths, settings, materials = project
    with pytest.raises(ShardError, match=r"\['00099'\] do not exist.*rematerialize the corpus"):
        build_shards(paths, settings, materials, "train", ["00099"])
    assert set(HALVES) == {"teacher", "student"}


# -- live figures ----------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_rate_and_eta_ignore_reused_work():
    clock, lines = FakeClock(), []
    progress = Progress("train teacher", 100, log_every_s=10, clock=clock, emit=lines.append)
    progress.skip(50)  # reused shards: progress moves, the rate does not
    clock.now = 5.0
    progress.advance(10, tokens=1000)
    assert lines == []  # not yet 10 s since the last line
    clock.now = 10.0
    progress.advance(10, tokens=1000)
    figures = progress.figures()
    assert figures["prompts_per_s"] == 2.0 and figures["tokens_per_s"] == 200.0 and figures["eta_s"] == 15.0
    assert lines == ["train teacher: 70/100 prompts (70%), 2.00 prompts/s, 200 tokens/s, ETA 15s"]
    clock.now = 25.0
    progress.advance(30)
    assert lines[-1].startswith("train teacher: 100/100 prompts (100%)") and lines[-1].endswith("ETA 0s")
    assert format_seconds(3725) == "1h02m05s" and format_seconds(float("inf")) == "?"


def test_progress_eta_ignores_the_model_load_and_says_when_all_was_reused():
    clock, lines = FakeClock(), []
    progress = Progress("train student", 2700, log_every_s=1, clock=clock, emit=lines.append)
    clock.now = 180.0  # loading the model
    progress.advance(32)
    assert lines[-1] == "train student: 32/2700 prompts (1%), measuring speed"  # not "ETA 4h"
    clock.now = 181.0
    progress.advance(32)
    assert progress.figures()["prompts_per_s"] == 32.0 and lines[-1].endswith("ETA 1m22s")
    reused = Progress("val teacher", 200, log_every_s=1, clock=clock, emit=lines.append)
    reused.skip(200)
    assert lines[-1] == "val teacher: 200/200 prompts (100%), already current"


def test_hardware_sampler_summarizes_gpu_and_host_figures():
    readings = iter([10.0, 50.0, 90.0, 90.0, 90.0, 90.0])

    def gpus():
        util = next(readings, 90.0)
        return [{"index": 0, "util_pct": util, "mem_used_gib": util / 10, "temp_c": 40 + util / 10,
                 "power_w": 2 * util}]

    clock = FakeClock()
    sampler = HardwareSampler(interval_s=3600, read_gpus=gpus,
                              read_host=lambda: {"cpu_pct": 20.0, "ram_used_gib": 3.0, "process_rss_gib": 1.0},
                              clock=clock)
    for t in (0.0, 1.0, 2.0):
        clock.now = t
        sampler.sample()
    s = sampler.summary()
    assert s["hw_samples"] == 3 and s["gpu0_util_pct_mean"] == 50.0 and s["gpu0_util_pct_max"] == 90.0
    assert s["gpu0_mem_used_gib_max"] == 9.0 and s["gpu0_temp_c_max"] == 49.0 and s["gpu0_power_w_mean"] == 100.0
    assert "gpu0_mem_used_gib_mean" not in s and s["host_ram_used_gib_max"] == 3.0
    assert sampler.summary(since=1.5)["gpu0_util_pct_mean"] == 90.0

    def broken():
        raise OSError("NVML went away")
    quiet = HardwareSampler(read_gpus=broken, read_host=dict)
    assert quiet.sample() == {} and quiet.summary() == {"hw_samples": 0.0}


def test_nvml_absent_degrades_to_no_gpu_figures():
    reader = NvmlReader()
    if reader.available:  # pragma: no cover - only on NVIDIA machines
        pytest.skip("this machine has an NVIDIA driver")
    assert reader.read() == []
    with HardwareSampler(interval_s=0.01) as sampler:
        pass
    summary = sampler.summary()
    assert summary["hw_samples"] >= 2 and not sampler.has_gpus and "host_cpu_pct_max" in summary
