"""The memory estimate counts what loads: checked against the safetensors library's own reader and the
adapter's real state dict."""

import json

import pytest
from conftest import assert_fits_80_columns, cli_env, unwrapped
from safetensors import safe_open
from warm_runs import trainer_run

from gguf_assets.lib.planning.estimate import GIB, adapter_params, estimate, kept_steps_text, peak_gib
from gguf_assets.lib.project.seed_reference import DEMO_CPU_TRAINING, DEMO_CPU_TRAINING_SHAPE
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.telemetry.progress import format_seconds
from gguf_assets.lib.training.adapter import Adapter, AdapterShape


@pytest.mark.parametrize("shape", [AdapterShape(48, 256, 64, 64, 1), AdapterShape(96, 8, 32, 128, 3),
                                   AdapterShape(1024, 16, 48, 1024, 2)])
def test_adapter_params_match_the_adapters_state_dict(shape):
    """ggk's resampler (no student-side norm, no null memory: four LayerNorms a block), its statistics buffers
    included: the checkpoint's whole state dict."""
    model = Adapter(shape)
    counted = adapter_params(shape.student_dim, shape.query_rows, shape.target_dim, shape.width, shape.depth)
    assert counted == sum(tensor.numel() for tensor in model.state_dict().values())
    assert counted - sum(b.numel() for b in model.buffers()) == sum(p.numel() for p in model.parameters())


def _numel(folder, skip=""):
    total = 0
    for file in folder.glob("*.safetensors"):
        if file.name != skip:
            with safe_open(str(file), "pt") as fh:
                for key in fh.keys():
                    count = 1
                    for dim in fh.get_slice(key).get_shape():
                        count *= dim
                    total += count
    return total


def test_the_estimate_counts_the_demo_pairs_weights_and_the_training_state(make_project):
    paths = make_project()
    settings = replace(load_settings(paths.root), precompute={"mock_teacher": False}, training={"ema_decay": 0.99})
    write_project_file(paths.root, settings)
    demo = paths.root / "materials" / "demo"
    lines = {line.part: line for line in estimate(paths, settings)}
    assert lines["teacher"].gib == pytest.approx(_numel(demo / "teacher", "query_rows.safetensors") * 2 / GIB)
    assert lines["student"].gib == pytest.approx(_numel(demo / "student") * 2 / GIB)  # bf16
    training = lines["adapter training"]
    assert training.gib > 0 and "weight average" in training.how and "20 bytes" in training.how
    assert peak_gib(list(lines.values())) == max(lines["teacher"].gib + lines["student"].gib, training.gib)

    done = trainer_run(["estimate", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert done.returncode == 0 and "peak on one GPU" in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert_fits_80_columns(done.stdout)  # 361 columns wide before it wrapped
    printed = unwrapped(done.stdout)
    assert [line.split()[0] for line in printed[1:4]] == ["teacher", "student", "adapter"]
    assert "kept steps on a schedule: off (training.keep_steps_every 0)" in printed  # the default
    # Nothing ran here yet and the demo trains on the CPU: a CPU figure, scaled from the demo's own CPU measurement
    # (the seed's is a GPU's: "under 1s" for the demo), with the seed's GPU figure for comparison.
    (training,) = [line for line in printed if line.startswith("  training")]
    t, demo = settings.training, DEMO_CPU_TRAINING_SHAPE
    seconds = t.steps / DEMO_CPU_TRAINING.per_second * (t.batch_size * t.depth * t.width ** 2) / (
        demo["batch_size"] * demo["depth"] * demo["width"] ** 2)
    assert training.startswith(f"  training on this machine's CPU (training.device is cpu): about "
                               f"{format_seconds(seconds)} for {t.steps} steps, scaled from the demo's measurement on "
                               "2 CPU cores (1,200 steps in 1m02s at width 128, depth 1, batch 16)"), training
    assert "On a GPU like the seed's: under 1s, scaled from the seed's measurement" in training
    (precompute,) = [line for line in printed if line.startswith("  precompute")]
    assert precompute.startswith("  precompute on this machine's CPU (precompute.device is cpu): not known before its "
                                 "first shard"), precompute
    # `status` shows the same peak before the shards are computed ("will it fit?", before anything loads).
    status = trainer_run(["status", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert_fits_80_columns(status.stdout)
    (memory,) = [line for line in unwrapped(status.stdout) if line.strip().startswith("memory:")]
    peak = next(line for line in printed if "peak on one GPU" in line).split()[4:6]
    assert f"peak on one GPU {' '.join(peak)} (teacher " in memory and "estimate" in memory, status.stdout


def test_the_kept_steps_preview_counts_the_files_the_schedule_leaves_and_their_size(make_project):
    """Before the run: how many kept steps training.keep_steps_* leaves on disk, each the adapter's f32 weights."""
    paths = make_project(steps=120, mock_teacher=True)
    settings = load_settings(paths.root)
    lines = estimate(paths, settings)
    (params,) = [line.params for line in lines if line.part == "adapter training"]
    assert params and kept_steps_text(settings, lines) == \
        "kept steps on a schedule: off (training.keep_steps_every 0)"
    # Every 20 from 40: 40, 60, 80, 100, 120; the newest 3 stay.
    kept = replace(settings, training={"keep_steps_every": 20, "keep_steps_from": 40, "keep_steps_last": 3})
    assert kept_steps_text(kept, lines) == (f"kept steps on a schedule: 3 files, {3 * 4 * params / 2**20:.1f} MiB "
                                            "(training.keep_steps_every 20 from 40, the newest 3 kept: steps 80, "
                                            "100, 120)")
    window = replace(settings, training={"keep_steps_every": 10, "keep_steps_to": 100})
    unknown = [line for line in lines if line.part != "adapter training"]  # the adapter's shape not known yet
    assert kept_steps_text(window, unknown) == ("kept steps on a schedule: 10 files, size ? (training.keep_steps_every "
                                                "10 to 100: steps 10 to 100)")


def test_a_hub_model_not_downloaded_yet_is_unknown_not_zero(make_project, monkeypatch):
    from conftest import free_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    paths = make_project(materials={"teacher": "org/big-teacher"}, precompute={"mock_teacher": False})
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root))}
    assert lines["teacher"].gib is None and "org/big-teacher" in lines["teacher"].how
    assert "the estimate needs the hub" in lines["teacher"].how
    assert lines["adapter training"].gib is None and peak_gib(list(lines.values())) is None


def _large_pair_script():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[3] / "benchmarks" / "estimate_large.py"
    spec = importlib.util.spec_from_file_location("estimate_large", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_30b_class_moe_teacher_and_a_0_6b_student_from_config_json_alone_match_the_placement_planner(tmp_path):
    """Config-only folders (no weights downloaded): the estimate builds them on the meta device, and the
    precompute's own planner puts exactly that many GiB on the devices."""
    import torch

    from gguf_assets.lib.planning.estimate import teacher_placements
    from gguf_assets.lib.precompute.teacher import plan_placement
    from gguf_assets.lib.project.layout import ProjectPaths

    large = _large_pair_script()
    project = large.build_pair(tmp_path)
    paths, settings = ProjectPaths.of(project), load_settings(project)
    lines = {line.part: line for line in estimate(paths, settings)}
    materials = settings.materials
    teacher_dir, student_dir = paths.resolve_local(materials.teacher), paths.resolve_local(materials.student)
    assert [f.name for f in teacher_dir.glob("*.safetensors")] == ["query_rows.safetensors"]  # no weights
    assert "meta device" in lines["teacher"].how and "meta device" in lines["student"].how
    assert 29e9 < lines["teacher"].gib * GIB / 2 < 31e9  # 30B-class, in bf16
    assert 0.55e9 < lines["student"].gib * GIB / 2 < 0.65e9  # 0.6B-class, in bf16

    two_gpus = {0: 80 * GIB, 1: 80 * GIB}
    planned = plan_placement(teacher_dir, settings, torch.device("cuda:0"), dtype=torch.bfloat16,
                             free_gpu_bytes=two_gpus, available_cpu_bytes=128 * GIB)
    assert sum(v["gib"] for v in planned.summary.values()) == pytest.approx(lines["teacher"].gib, rel=1e-4)
    student_planned = plan_placement(student_dir, settings, torch.device("cpu"), dtype=torch.bfloat16)
    assert student_planned.summary["cpu"]["gib"] == pytest.approx(lines["student"].gib, rel=1e-4)
    assert lines["adapter training"].gib > 0 and peak_gib(list(lines.values())) == pytest.approx(
        lines["teacher"].gib + lines["student"].gib)

    placements = teacher_placements(teacher_dir, settings, free_gpu_bytes=two_gpus, available_cpu_bytes=128 * GIB)
    assert placements["sequential"] == planned.summary  # the precompute's planner: all of it on the first GPU
    assert set(planned.summary) == {"cuda:0"} and planned.summary["cuda:0"]["layers"] == large.QWEN3_MOE_30B_A3B[
        "num_hidden_layers"]
    balanced = placements["balanced"]
    assert set(balanced) >= {"cuda:0", "cuda:1"} and balanced["cuda:0"]["gib"] < 0.6 * lines["teacher"].gib
    assert sum(v["gib"] for v in balanced.values()) == pytest.approx(lines["teacher"].gib, rel=1e-4)


def test_the_estimate_says_where_the_teacher_would_go_on_the_gpus_there_are(tmp_path):
    from gguf_assets.lib.planning.estimate import estimate_lines
    from gguf_assets.lib.project.layout import ProjectPaths

    project = _large_pair_script().build_pair(tmp_path)
    paths, settings = ProjectPaths.of(project), load_settings(project)
    gpus = [{"index": 0, "mem_total_gib": 80.0, "mem_used_gib": 0.5}, {"index": 1, "mem_total_gib": 80.0,
                                                                         "mem_used_gib": 0.5}]
    lines = estimate_lines(paths, settings, gpus=gpus)
    assert "this machine: GPU 0 80 GiB, GPU 1 80 GiB" in lines[3]
    sequential, balanced, speed = lines[4:]
    assert sequential.startswith("  teacher placement sequential (precompute.teacher_placement): cuda:0 48 layers ")
    assert balanced.startswith("  teacher placement balanced: cuda:0 ") and "cuda:1" in balanced
    assert sequential.endswith("-> all on one GPU; about 4.5 prompts/s") and speed.startswith("  speed: the seed's")
    assert estimate_lines(paths, settings, gpus=[])[4:] == []  # no GPU: nothing to place on
    on_cpu = replace(settings, precompute={"device": "cpu"})
    assert estimate_lines(paths, on_cpu, gpus=gpus)[4:] == [  # the precompute keeps it all on the CPU: said so
        "  teacher placement: precompute.device = 'cpu' keeps the teacher in RAM; set it to auto or cuda to place it "
        "on GPUs"]


# ---------------------------------------------------------------- "will it fit?" before any weight is downloaded

def test_the_speed_is_the_seeds_measurement_interpolated_by_the_offloaded_share():
    from gguf_assets.lib.planning.estimate import placement_outcome, prompts_per_s

    assert prompts_per_s(0.0) == pytest.approx(4.5) and prompts_per_s(0.5) == pytest.approx(2.4)
    assert 2.4 < prompts_per_s(0.25) < 4.5 and prompts_per_s(1.0) < 2.4
    assert placement_outcome({"cuda:0": {"layers": 3, "gib": 4.0}}) == "all on one GPU; about 4.5 prompts/s"
    assert placement_outcome({"cuda:0": {"layers": 2, "gib": 2.0}, "cuda:1": {"layers": 1, "gib": 2.0}}).startswith(
        "teacher split over 2 GPUs, nothing offloaded; about 4.5")
    assert placement_outcome({"cuda:0": {"layers": 2, "gib": 2.0}, "cpu": {"layers": 2, "gib": 2.0}}) == (
        "teacher partly offloaded: 50% of it in CPU RAM; about 2.4 prompts/s")


T2I, T2I_FILE, ROWS_NAME = "org/t2i-model", "transformer/model.safetensors", "text_proj.learned_query_tokens"
STOCK_MOE = "stock/tiny-moe"


def _sharded(folder) -> dict[str, bytes]:
    """A stock hub LLM repo of a local model folder: its weights in two shards with their index, no query rows."""
    from safetensors.torch import load_file, save

    weights = load_file(folder / "model.safetensors")
    names = sorted(weights)
    halves = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    files = {shard: save({k: weights[k] for k in keys}) for shard, keys in halves.items()}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        files[name] = (folder / name).read_bytes()
    return files


def _rows_checkpoint(rows) -> bytes:
    """A text-to-image checkpoint holding the rows beside a bigger tensor that must not be fetched."""
    import torch
    from safetensors.torch import save

    return save({"blocks.0.attn.weight": torch.randn(512, 512, generator=torch.Generator().manual_seed(0)),
                 ROWS_NAME: rows.clone()})


def test_hub_ids_are_estimated_from_config_and_headers_without_their_weights(make_project, loopback_hub,
                                                                             demo_materials_root):
    """A stock teacher repo (sharded, no query rows) and the rows inside another repo's checkpoint: the estimate
    reads config.json, the index and one header, a few KiB, and counts what the local folders count."""
    from safetensors.torch import load_file

    from gguf_assets.lib.planning.estimate import config_params, estimate_lines

    stock = _sharded(demo_materials_root / "teacher")
    rows = load_file(demo_materials_root / "teacher" / "query_rows.safetensors")["query_rows"][:200]
    loopback_hub.add_repo(STOCK_MOE, stock)
    loopback_hub.add_repo(T2I, {T2I_FILE: _rows_checkpoint(rows)})
    paths = make_project(materials={"teacher": STOCK_MOE, "student": "demo/student@main",
                                    "query_rows": {"source": T2I, "file": T2I_FILE, "tensor": ROWS_NAME}},
                         precompute={"mock_teacher": False, "device": "auto"})
    settings = load_settings(paths.root)

    lines = {line.part: line for line in estimate(paths, settings)}

    weights = sum(len(data) for name, data in stock.items() if name.endswith(".safetensors"))
    served = sum(loopback_hub.served.values())
    assert served < weights / 20 and served < 16 * 1024, loopback_hub.served  # kilobytes, not the weights
    assert not any(name.endswith(".safetensors") and "model-" in name for name in loopback_hub.served)
    teacher_params = config_params(demo_materials_root / "teacher", settings)
    assert lines["teacher"].gib == pytest.approx(teacher_params * 2 / GIB)
    assert "config.json from the hub at " + loopback_hub.head(STOCK_MOE)[:12] in lines["teacher"].how
    assert "in 2 file(s), not downloaded" in lines["teacher"].how
    assert lines["student"].gib == pytest.approx(config_params(demo_materials_root / "student", settings) * 2 / GIB)
    training = lines["adapter training"]
    assert training.gib > 0 and f"{rows.shape[0]} x {rows.shape[1]} out" in training.how
    assert f"rows from the header of {T2I}:{T2I_FILE}" in training.how
    assert not (paths.materials_dir / "manifest.json").exists()  # nothing was resolved, nothing downloaded

    # Kept in the project's .cache: the next estimate (status, the studio) asks the hub nothing.
    before = len(loopback_hub.requests)
    assert [line.gib for line in estimate(paths, settings)] == [line.gib for line in lines.values()]
    assert len(loopback_hub.requests) == before and (paths.cache_dir / "hub").is_dir()

    # --gpus: the GPUs the user names, the teacher's placement on them and its speed.
    out = estimate_lines(paths, settings, gpu_sizes_gib=[24, 24])
    assert "--gpus GPU 0 24 GiB, GPU 1 24 GiB" in out[3]
    assert out[4].startswith("  teacher placement sequential (precompute.teacher_placement): cuda:0 3 layers ")
    assert out[4].endswith("-> all on one GPU; about 4.5 prompts/s") and out[6].startswith("  speed: the seed's")


def test_a_30b_a3b_shaped_hub_teacher_is_estimated_from_its_config_and_index_alone(make_project, loopback_hub):
    """Qwen/Qwen3-30B-A3B's shape on the hub, its 16 shards announced at their real size: the estimate reads
    config.json and the index (kilobytes), says 57 GB are not downloaded, and places it on --gpus 24,24."""
    from transformers import Qwen3MoeConfig

    from gguf_assets.lib.planning.estimate import estimate_lines

    large = _large_pair_script()
    config = Qwen3MoeConfig(**large.QWEN3_MOE_30B_A3B).to_json_string().encode()
    shards = [f"model-{i:05d}-of-00016.safetensors" for i in range(1, 17)]
    index = json.dumps({"metadata": {"total_size": 61_064_245_248},
                        "weight_map": {f"model.layers.{i}.mlp.gate.weight": shards[i % 16] for i in range(48)}})
    repo = "Qwen/Qwen3-30B-A3B"
    loopback_hub.add_repo(repo, {"config.json": config, "model.safetensors.index.json": index.encode(),
                                 **{shard: b"\0" * 8 for shard in shards}})
    for shard in shards:
        loopback_hub.announce_size(repo, shard, 3_816_515_328)
    paths = make_project(materials={"teacher": repo, "student": "demo/student"},
                         precompute={"mock_teacher": False, "device": "auto"})

    out = estimate_lines(paths, load_settings(paths.root), gpu_sizes_gib=[24, 24], available_cpu_bytes=128 * GIB)

    assert sum(loopback_hub.served.values()) < 64 * 1024 and not any(s in loopback_hub.served for s in shards)
    teacher = out[0]
    assert "56.29 GiB" in teacher and "30.22 B parameters" in teacher and "56.87 GiB in 16 file(s)" in teacher
    assert "Q = 256 assumed" in out[2]  # no rows named: the usual 256, and what to add to count the real ones
    sequential = out[4]
    assert "cuda:0 " in sequential and "cuda:1 " in sequential and ", cpu " in sequential
    assert "teacher partly offloaded: 27% of it in CPU RAM; about 3.1 prompts/s" in sequential


@pytest.mark.slow  # 20 to 75 s on 2 busy cores: `estimate` and `status` as the user runs them (two CLI processes)
def test_a_config_only_folder_without_query_rows_gets_a_one_line_answer(make_project, demo_materials_root):
    """config.json alone (the weights and the rows not there yet): `estimate` and `status` answer, exit 0, no
    traceback; a folder without even config.json is one line saying what to add."""
    paths = make_project(materials={"teacher": "models/teacher"}, precompute={"mock_teacher": False, "device": "auto"})
    (paths.root / "models" / "teacher").mkdir(parents=True)
    (paths.root / "models" / "teacher" / "config.json").write_bytes(
        (demo_materials_root / "teacher" / "config.json").read_bytes())

    done = trainer_run(["estimate", str(paths.root), "--gpus", "24"], capture_output=True, text=True,
                       env=cli_env(), timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr  # no library noise (accelerate warned of each GPU named but not here)
    teacher, student, training = unwrapped(done.stdout)[1:4]
    assert "from config.json on the meta device: no weights here yet" in teacher and "?" not in teacher.split()[1]
    assert "Q = 256 assumed (the usual): add query_rows.safetensors to the teacher folder or set " \
           "materials.query_rows" in training
    status = trainer_run(["status", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert "Traceback" not in status.stderr, status.stderr
    (memory,) = [line for line in unwrapped(status.stdout) if line.strip().startswith("memory:")]
    assert memory.strip().startswith("memory: peak on one GPU "), status.stdout

    (paths.root / "models" / "teacher" / "config.json").unlink()
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root))}
    assert lines["teacher"].gib is None and lines["teacher"].how.endswith(
        "has no config.json; add the model's config.json (the weights may come later)")


def test_an_unreachable_hub_is_one_line_quickly(make_project, monkeypatch):
    """Nothing listens at HF_ENDPOINT: `status` says in one line that the estimate needs the hub, within
    seconds, and asks again only after a while (its .cache remembers)."""
    import time

    from conftest import free_port

    from gguf_assets.lib.materials import hub_shapes

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    paths = make_project(materials={"teacher": "org/big-teacher"}, precompute={"mock_teacher": False})
    started = time.monotonic()
    status = trainer_run(["status", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    (memory,) = [line for line in unwrapped(status.stdout) if line.strip().startswith("memory:")]
    assert memory.strip().startswith("memory: not known yet: the estimate needs the hub for org/big-teacher: ")
    assert "cannot be reached" in memory, memory
    assert time.monotonic() - started < 60
    before = time.monotonic()
    lines = estimate(paths, load_settings(paths.root), options=hub_shapes.quick_options())
    assert lines[0].gib is None and "cannot be reached" in lines[0].how
    assert time.monotonic() - before < 5  # remembered for hub_shapes.RETRY_AFTER_S: no new try


def test_the_mock_teacher_needs_only_the_students_config(make_project):
    paths = make_project(mock_teacher=True)
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root))}
    assert lines["teacher"].gib == 0.0 and lines["adapter training"].gib > 0
    assert "256 x 64 out" in lines["adapter training"].how  # the mock teacher's targets


def test_a_gated_hub_teacher_is_read_with_the_hf_token_and_without_it_is_one_line(make_project, loopback_hub,
                                                                                  demo_materials_root):
    """The token the materials step sends (HF_TOKEN) opens a gated repo for the estimate too; it never shows."""
    loopback_hub.add_repo("gated/teacher", demo_materials_root / "teacher", gated=True)
    paths = make_project(materials={"teacher": "gated/teacher", "student": "demo/student"},
                         precompute={"mock_teacher": False})
    refused = estimate(paths, load_settings(paths.root))[0]
    assert refused.gib is None and "gated/teacher" in refused.how and "gated" in refused.how.split(": ", 1)[1]
    lines = estimate(paths, load_settings(paths.root), token=loopback_hub.token)  # asked again at once
    assert lines[0].gib > 0 and all(loopback_hub.token not in line.how for line in lines)
    assert any(r["auth"] == "granted" for r in loopback_hub.requests if "gated/teacher" in r["path"])


def test_a_teacher_that_would_spill_to_disk_is_said_not_to_fit():
    from gguf_assets.lib.planning.estimate import placement_outcome

    assert placement_outcome({"cuda:0": {"layers": 2, "gib": 20.0}, "cpu": {"layers": 2, "gib": 20.0},
                              "disk": {"layers": 1, "gib": 9.5}}).startswith("does not fit: 9.50 GiB would go to disk")


def test_a_silent_hub_costs_status_one_short_wait(make_project, loopback_hub, caplog):
    """A hub that takes the connection and never answers (a stalled mirror): the quick bound status and the
    studio use ends the wait within seconds, once for both models, and the next ask is answered from the .cache."""
    import time

    from gguf_assets.lib.materials import hub_shapes

    paths = make_project(materials={"teacher": "demo/teacher", "student": "demo/student"},
                         precompute={"mock_teacher": False})
    loopback_hub.go_silent()
    started = time.monotonic()
    lines = estimate(paths, load_settings(paths.root), options=hub_shapes.quick_options())
    took = time.monotonic() - started
    assert lines[0].gib is None and lines[1].gib is None and "8 s" in lines[1].how, lines
    assert took < hub_shapes.QUICK["answer_timeout_s"] + 12, took  # one wait (the student's), not one per model
    assert "listing failed" not in caplog.text  # one try: its failure is the line, no warning before it
    started = time.monotonic()
    assert estimate(paths, load_settings(paths.root), options=hub_shapes.quick_options())[0].gib is None
    assert time.monotonic() - started < 3


def test_a_middle_layer_teacher_is_counted_with_the_blocks_it_keeps(make_project):
    """materials.teacher_layer = 1 builds and loads the teacher's first block only (lib/precompute/teacher.py): the
    estimate counts that, not the whole teacher."""
    paths = make_project()
    whole = replace(load_settings(paths.root), precompute={"mock_teacher": False})
    middle = replace(whole, materials={"teacher_layer": 1})
    teacher = paths.root / "materials" / "demo" / "teacher"
    with safe_open(str(next(teacher.glob("model*.safetensors"))), "pt") as fh:
        later_blocks = sum(_prod(fh.get_slice(k).get_shape()) for k in fh.keys()
                           if ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= 1)
    full, cut = (next(line for line in estimate(paths, s) if line.part == "teacher") for s in (whole, middle))
    assert later_blocks > 0
    assert full.gib - cut.gib == pytest.approx(later_blocks * 2 / GIB)
    assert "its first 1 layers: materials.teacher_layer" in cut.how


def _prod(shape) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
