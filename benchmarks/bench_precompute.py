"""Precompute throughput on a length-skewed prompt set with the demo teacher (Q = 256 query rows).

Prints four figures, each against a baseline measured in the same run:

* packing: token-budget packing (length-sorted) vs naive fixed-size padded batches in the
  original order, as a throughput ratio of the bare model forwards (target >= 1.5x);
* padding efficiency of the packed batches: real / computed token slots, query rows counted
  as real (target >= 0.9);
* overhead of the whole teacher half of a shard (tokenize, pack, assemble, forward, gather,
  cast, safetensors write, sha256, sidecar: ShardBuilder.build) vs the bare model forwards
  on the same batches (target <= 10 %). The forwards are also timed inside the pipeline run
  itself, which makes that ratio immune to load from other processes; the ratio against the
  separately timed forwards is printed too;
* a teacher read at a middle layer (materials.teacher_layer; the demo teacher's config with
  MIDDLE_TEACHER_LAYERS blocks of random weights, read at MIDDLE_LAYER): built with only the blocks
  below that layer, as HFTeacher does, against the whole model's forward keeping every layer's
  output (what HFTeacher did before #58), on the same packed batches of the first MIDDLE_PROMPTS
  short prompts (the blocks' cost is measured, not packing's): prompts/s of each, the speedup,
  the weights and the layer outputs each holds (on CUDA also the peak memory of the forwards),
  and the largest difference of the states they read.

    .venv/bin/python benchmarks/bench_precompute.py [--prompts 256] [--repeats 3] [--device cpu] [--threads N]
                                                    [--middle-prompts 64]
    .venv/bin/python benchmarks/bench_precompute.py --quick    # 48 prompts (16 in the middle-layer case),
                                                               # 1 repeat, 1 thread (the test runs this)

Each timing is the best of --repeats interleaved runs, which keeps other processes' noise out.

The rule (exit status 1 when it fails): packing is at least 1.5x faster than the naive batches,
its padding efficiency is at least 1.5x the naive batches' (a property of the batches, not a
timing: 1.8-2.6x here), and the pipeline's overhead over its own forwards is at most 25 % (it
measures 3-8 %; the 10 % target holds at real sizes, where fixed costs weigh less). The packed
efficiency's own 0.9 target needs enough prompts to pack (0.98 at 256; 0.7-0.93 below 100).
A second rule line: the middle-layer teacher is at least 1.5x faster than the whole model's forward
(2 of 8 blocks run: 4.1x at 256 prompts, 1 thread), and reads the same states (bit for bit on the
CPU; within bf16 rounding on a GPU, where kernels need not add in the same order).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.demo.demo import build_demo_materials, demo_settings, iter_prompts
from gguf_assets.lib.precompute.batching import fixed_batches, pack_batches, padding_efficiency
from gguf_assets.lib.precompute.shards import ShardBuilder
from gguf_assets.lib.precompute.shards_run import HALVES, ShardPlan
from gguf_assets.lib.precompute.teacher import HFTeacher
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import replace

LONG_FRACTION = 0.2
LONG_TOKENS = (600, 1400)
MIN_PACKING_SPEEDUP = 1.5     # naive forwards' seconds / packed forwards' seconds
MIN_EFFICIENCY_GAIN = 1.5     # packed padding efficiency / naive padding efficiency
MAX_OVERHEAD_PERCENT = 25.0   # the whole pipeline over the forwards timed inside it
MIDDLE_TEACHER_LAYERS = 8     # blocks of the middle-layer case's teacher
MIDDLE_LAYER = 2              # the layer it is read at (materials.teacher_layer)
MIDDLE_PROMPTS = 64           # the first short prompts it reads (--quick: 16)
MIN_MIDDLE_SPEEDUP = 1.5      # whole model's forwards' seconds / the kept blocks' forwards' seconds
# Largest |difference| of the states read, relative to their largest |value|: none on the CPU (measured: 0); elsewhere
# bf16 rounding (not measured yet: GPU kernels need not add in the same order from one model to the other).
MAX_MIDDLE_DIFF = {"cpu": 0.0}
MAX_MIDDLE_DIFF_BF16 = 2**-6
MIB = 2**20


def skewed_prompts(dataset: Path, teacher: HFTeacher, count: int, *, seed: int = 0) -> list[str]:
    """Mostly short demo prompts, with LONG_FRACTION long ones (several prompts joined), shuffled."""
    rng = random.Random(seed)
    pool = list(iter_prompts(dataset))
    prompts = []
    for _ in range(count):
        if rng.random() >= LONG_FRACTION:
            prompts.append(rng.choice(pool))
            continue
        target, parts = rng.randint(*LONG_TOKENS), []
        while len(teacher.tokenize([". ".join(parts)])[0][0]) < target:
            parts.append(rng.choice(pool))
        prompts.append(". ".join(parts))
    return prompts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def bare_forward_seconds(teacher: HFTeacher, tokens: list[list[int]], batches: list[list[int]]) -> float:
    """Only the model forwards: inputs are assembled before the clock starts."""
    inputs = [teacher.assemble([tokens[i] for i in b])[:2] for b in batches]
    _sync(teacher.device)
    start = time.perf_counter()
    for embeds, mask in inputs:
        teacher.forward_batch(embeds, mask)
    _sync(teacher.device)
    return time.perf_counter() - start


def deep_teacher(demo_teacher: Path, folder: Path, layers: int) -> Path:
    """The demo teacher's tokenizer and query rows with its config at ``layers`` blocks of (seeded) random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(demo_teacher, folder)
    config = AutoConfig.from_pretrained(folder, num_hidden_layers=layers)
    torch.manual_seed(0)
    quiet_libraries()
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)  # over the demo teacher's weights and config
    return folder


def whole_model_states(teacher: HFTeacher):
    """What HFTeacher.forward_batch ran before #58 for a middle layer: every block, every layer's output kept (it
    then picked one of them)."""
    def forward(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return teacher.model(inputs_embeds=embeds, attention_mask=mask, use_cache=False,
                             output_hidden_states=True).hidden_states
    return forward


@torch.inference_mode()
def forwards_seconds(forward, inputs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for embeds, mask in inputs:
        forward(embeds, mask)
    _sync(device)
    return time.perf_counter() - start


def _peak_mib(forward, embeds: torch.Tensor, mask: torch.Tensor, device: torch.device):
    """(the forward's result, MiB allocated at its peak above what was allocated before it: CUDA only, else None)."""
    if device.type != "cuda":
        return forward(embeds, mask), None
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = forward(embeds, mask)
    return out, (torch.cuda.max_memory_allocated(device) - before) / MIB


def _mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values()) / MIB


@torch.inference_mode()
def compared_pass(whole, middle, inputs: list[tuple[torch.Tensor, torch.Tensor]], layer: int,
                  device: torch.device) -> dict[str, float | None]:
    """One forward of each on every batch, which is also the warm-up: the largest |difference| of the states they
    read relative to the states' largest |value|, the MiB of layer outputs each leaves held (the widest batch) and,
    on CUDA, each one's largest peak MiB."""
    diff = scale = 0.0
    out: dict[str, float | None] = {"held_before": 0.0, "held_after": 0.0, "peak_before": None, "peak_after": None}
    widest = max(range(len(inputs)), key=lambda i: inputs[i][0].numel())
    for i, (embeds, mask) in enumerate(inputs):
        states, peak_before = _peak_mib(whole, embeds, mask, device)
        got, peak_after = _peak_mib(middle, embeds, mask, device)
        expected = states[layer].float()
        diff = max(diff, float((got.float() - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
        if i == widest:
            out["held_before"], out["held_after"] = _mib(states), _mib([got])
        for key, value in (("peak_before", peak_before), ("peak_after", peak_after)):
            out[key] = value if out[key] is None else max(out[key], value)
        del states, got, expected
    out["relative_diff"] = diff / scale if scale else diff
    return out


def weights_mib(teacher: HFTeacher) -> float:
    return _mib(teacher.model.parameters())


def middle_layer_case(demo_teacher: Path, work: Path, settings, tokens: list[list[int]], repeats: int,
                      device: torch.device) -> tuple[bool, list[str]]:
    """The middle-layer teacher against the whole model's forward on ``tokens``: (rule holds, printed lines)."""
    folder = deep_teacher(demo_teacher, work / "deep-teacher", MIDDLE_TEACHER_LAYERS)
    whole = HFTeacher(folder, replace(settings, materials={"teacher_layer": -1}), device)
    middle = HFTeacher(folder, replace(settings, materials={"teacher_layer": MIDDLE_LAYER}), device)
    p, q = settings.precompute, middle.n_query
    batches = pack_batches([len(t) for t in tokens], max_batch=p.teacher_batch, token_budget=p.token_budget,
                           extra_tokens=q)
    with torch.inference_mode():
        inputs = [middle.assemble([tokens[i] for i in b])[:2] for b in batches]
    before, after = whole_model_states(whole), middle.forward_batch
    seen = compared_pass(before, after, inputs, MIDDLE_LAYER, device)
    # Interleaved, so a burst of load from elsewhere hits both alike; the best run of each counts.
    runs = [(forwards_seconds(before, inputs, device), forwards_seconds(after, inputs, device))
            for _ in range(repeats)]
    before_s, after_s = (min(column) for column in zip(*runs))
    n, speedup, relative = len(tokens), before_s / after_s, seen["relative_diff"]
    limit = MAX_MIDDLE_DIFF.get(device.type, MAX_MIDDLE_DIFF_BF16)
    ok = speedup >= MIN_MIDDLE_SPEEDUP and relative <= limit

    def peak(value: float | None) -> str:
        return "" if value is None else f", peak {value:.2f} MiB"

    lines = [
        f"middle-layer teacher: {MIDDLE_TEACHER_LAYERS} layers read at layer {MIDDLE_LAYER}, {n} prompts in "
        f"{len(batches)} packed batches",
        f"whole model, every layer's output kept (before): {before_s:.3f} s, {n / before_s:.2f} prompts/s, weights "
        f"{weights_mib(whole):.2f} MiB, layer outputs held {seen['held_before']:.2f} MiB{peak(seen['peak_before'])}",
        f"only the blocks below the layer (after):          {after_s:.3f} s, {n / after_s:.2f} prompts/s, weights "
        f"{weights_mib(middle):.2f} MiB, layer outputs held {seen['held_after']:.2f} MiB{peak(seen['peak_after'])}",
        f"middle-layer speedup:                 {speedup:.2f}x  (target >= {MIN_MIDDLE_SPEEDUP}x); states read differ "
        f"by at most {relative:.3g} of their largest |value|",
        f"rule: middle-layer speedup {speedup:.2f}x >= {MIN_MIDDLE_SPEEDUP}x and relative difference {relative:.3g} <= "
        f"{limit:.3g} -> {'ok' if ok else 'FAIL'}",
    ]
    return ok, lines


def pipeline_seconds(builder: ShardBuilder, prompts: list[str]) -> tuple[float, float, float]:
    """The real teacher half of a shard, from prompts to a verified file on disk (ShardBuilder.build).

    Returns (whole, before the disk writes, model forwards inside it): the forwards are timed
    in the same run, so the overhead split is immune to load from other processes.
    """
    teacher = builder.teacher()
    forward, inside = teacher.forward_batch, [0.0]

    def timed_forward(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        _sync(teacher.device)
        start = time.perf_counter()
        hidden = forward(embeds, mask)
        _sync(teacher.device)
        inside[0] += time.perf_counter() - start
        return hidden

    plan = ShardPlan("train", "00000", prompts, {half: f"bench-{half}" for half in HALVES})
    shutil.rmtree(plan.folder(builder.paths), ignore_errors=True)
    teacher.forward_batch = timed_forward
    try:
        start = time.perf_counter()
        report = builder.build(plan)
        seconds = time.perf_counter() - start
    finally:
        del teacher.forward_batch
    assert report.halves["teacher"].status == "missing", report
    return seconds, report.halves["teacher"].seconds, inside[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="48 prompts, 1 repeat, 1 torch thread: a smoke run")
    parser.add_argument("--prompts", type=int, help="prompts in the shard (default 256, --quick 48)")
    parser.add_argument("--repeats", type=int, help="interleaved runs of each timing (default 3, --quick 1)")
    parser.add_argument("--middle-prompts", type=int,
                        help=f"prompts the middle-layer teacher reads (default {MIDDLE_PROMPTS}, --quick 16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (0: torch's default; --quick: 1, since on a small shared machine "
                             "OpenMP teams of 2+ threads stall on busy neighbours: minutes instead of seconds)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (48 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.middle_prompts = args.middle_prompts or (16 if args.quick else MIDDLE_PROMPTS)
    args.threads = (1 if args.quick else 0) if args.threads is None else args.threads
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="bench-precompute-"))
    try:
        materials = build_demo_materials(work / "materials", seed=0)
        settings = replace(demo_settings(), precompute={"device": args.device, "mode": "teacher", "teacher_batch": 8,
                                                        "token_budget": 8192, "shard_size": args.prompts})
        device = torch.device(args.device)
        # Only the teacher half is built, so only the teacher is pinned.
        builder = ShardBuilder(ProjectPaths.of(work), settings, MaterialsManifest(
            teacher={"role": "teacher", "source": "demo/teacher", "path": str(materials.teacher_dir),
                     "commit": "bench"}))
        teacher = builder.teacher()
        prompts = skewed_prompts(materials.dataset_dir, teacher, args.prompts)
        tokens, truncated = teacher.tokenize(prompts)
        lengths = [len(t) for t in tokens]
        p, q = settings.precompute, teacher.n_query
        packed = pack_batches(lengths, max_batch=p.teacher_batch, token_budget=p.token_budget, extra_tokens=q)
        naive = fixed_batches(len(prompts), p.teacher_batch)

        # Warm-up: first calls allocate and pick kernels. The longest packed batches, and the naive batch
        # with the most token slots (its first run would otherwise cost several times the later ones).
        widest = max(naive, key=lambda b: len(b) * max(lengths[i] for i in b))
        bare_forward_seconds(teacher, tokens, [*packed[:2], widest])
        # Interleaved, so a burst of load from elsewhere hits all three alike; the best run of each counts.
        runs = [(bare_forward_seconds(teacher, tokens, naive), bare_forward_seconds(teacher, tokens, packed),
                 *pipeline_seconds(builder, prompts)) for _ in range(args.repeats)]
        naive_s, packed_s = (min(column) for column in list(zip(*runs))[:2])
        pipeline_s, compute_s, inside_s = min(run[2:] for run in runs)  # the fastest pipeline run, split
        short = [t for t in tokens if len(t) < LONG_TOKENS[0]][:args.middle_prompts]  # blocks' cost, not packing's
        middle_ok, middle_lines = middle_layer_case(materials.teacher_dir, work, settings, short, args.repeats, device)

        eff_packed = padding_efficiency(lengths, packed, extra_tokens=q)
        eff_naive = padding_efficiency(lengths, naive, extra_tokens=q)
        n = len(prompts)
        print(f"prompts: {n} ({sum(x >= LONG_TOKENS[0] for x in lengths)} long), text tokens: min {min(lengths)}, "
              f"median {sorted(lengths)[n // 2]}, max {max(lengths)}, truncated {truncated}; Q = {q}; "
              f"teacher_batch {p.teacher_batch}, token_budget {p.token_budget}; device {device}; "
              f"torch threads {torch.get_num_threads()}")
        print(f"naive fixed batches (original order): {len(naive)} batches, {naive_s:.3f} s, "
              f"{n / naive_s:.2f} prompts/s, padding efficiency {eff_naive:.3f}")
        print(f"token-budget packing:                 {len(packed)} batches, {packed_s:.3f} s, "
              f"{n / packed_s:.2f} prompts/s, padding efficiency {eff_packed:.3f}")
        print(f"whole pipeline (teacher half, packed): {pipeline_s:.3f} s, {n / pipeline_s:.2f} prompts/s, "
              f"{sum(lengths) / pipeline_s:.0f} text tokens/s")
        print(f"packing speedup vs naive:             {naive_s / packed_s:.2f}x  (target >= {MIN_PACKING_SPEEDUP}x)")
        print(f"end-to-end speedup vs naive forwards: {naive_s / pipeline_s:.2f}x")
        print(f"padding efficiency (packed):          {eff_packed:.3f}  (target >= 0.9)")
        print(f"pipeline overhead vs its own forwards: {100 * (pipeline_s / inside_s - 1):+.1f} %  (target <= 10 %; "
              f"{100 * (compute_s / inside_s - 1):+.1f} % before the disk writes)")
        print(f"pipeline vs separately timed forwards: {100 * (pipeline_s / packed_s - 1):+.1f} %  "
              "(includes load from other processes between the runs)")
        speedup, gain, overhead = naive_s / packed_s, eff_packed / eff_naive, 100 * (pipeline_s / inside_s - 1)
        ok = speedup >= MIN_PACKING_SPEEDUP and gain >= MIN_EFFICIENCY_GAIN and overhead <= MAX_OVERHEAD_PERCENT
        print(f"rule: packing speedup {speedup:.2f}x >= {MIN_PACKING_SPEEDUP}x and padding efficiency packed / naive "
              f"{gain:.2f}x >= {MIN_EFFICIENCY_GAIN}x and pipeline overhead {overhead:+.1f} % <= "
              f"{MAX_OVERHEAD_PERCENT:.0f} % -> {'ok' if ok else 'FAIL'}")
        print("\n".join(middle_lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok and middle_ok else 1


if __name__ == "__main__":
    sys.exit(main())
