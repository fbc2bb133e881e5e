"""Precompute throughput on a length-skewed prompt set with the demo teacher (Q = 256 query rows).

Prints three figures, each against a baseline measured in the same run:

* packing: token-budget packing (length-sorted) vs naive fixed-size padded batches in the
  original order, as a throughput ratio of the bare model forwards (target >= 1.5x);
* padding efficiency of the packed batches: real / computed token slots, query rows counted
  as real (target >= 0.9);
* overhead of the whole teacher half of a shard (tokenize, pack, assemble, forward, gather,
  cast, safetensors write, sha256, sidecar: ShardBuilder.build) vs the bare model forwards
  on the same batches (target <= 10 %). The forwards are also timed inside the pipeline run
  itself, which makes that ratio immune to load from other processes; the ratio against the
  separately timed forwards is printed too.

    .venv/bin/python benchmarks/bench_precompute.py [--prompts 256] [--repeats 3] [--device cpu] [--threads N]

Each timing is the best of --repeats interleaved runs, which keeps other processes' noise out.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gguf_assets.lib.precompute.batching import fixed_batches, pack_batches, padding_efficiency
from gguf_assets.lib.precompute.shards import HALVES, ShardBuilder, ShardPlan
from gguf_assets.lib.precompute.teacher import HFTeacher
from gguf_assets.lib.project.demo import build_demo_materials, demo_settings, iter_prompts
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import replace

LONG_FRACTION = 0.2
LONG_TOKENS = (600, 1400)


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
    assert report["teacher_status"] == "missing", report
    return seconds, report["teacher_seconds"], inside[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="bench-precompute-"))
    try:
        materials = build_demo_materials(work / "materials", seed=0)
        settings = replace(demo_settings(), precompute={"device": args.device, "mode": "teacher", "teacher_batch": 8,
                                                        "token_budget": 8192, "shard_size": args.prompts})
        device = torch.device(args.device)
        builder = ShardBuilder(ProjectPaths.of(work), settings, {"teacher": {"path": str(materials.teacher_dir)}})
        teacher = builder.teacher()
        prompts = skewed_prompts(materials.dataset_dir, teacher, args.prompts)
        tokens, truncated = teacher.tokenize(prompts)
        lengths = [len(t) for t in tokens]
        p, q = settings.precompute, teacher.n_query
        packed = pack_batches(lengths, max_batch=p.teacher_batch, token_budget=p.token_budget, extra_tokens=q)
        naive = fixed_batches(len(prompts), p.teacher_batch)

        bare_forward_seconds(teacher, tokens, packed[:2])  # warm-up: first calls allocate and pick kernels
        # Interleaved, so a burst of load from elsewhere hits all three alike; the best run of each counts.
        runs = [(bare_forward_seconds(teacher, tokens, naive), bare_forward_seconds(teacher, tokens, packed),
                 *pipeline_seconds(builder, prompts)) for _ in range(args.repeats)]
        naive_s, packed_s = (min(column) for column in list(zip(*runs))[:2])
        pipeline_s, compute_s, inside_s = min(run[2:] for run in runs)  # the fastest pipeline run, split

        eff_packed = padding_efficiency(lengths, packed, extra_tokens=q)
        eff_naive = padding_efficiency(lengths, naive, extra_tokens=q)
        n = len(prompts)
        print(f"prompts: {n} ({sum(x >= LONG_TOKENS[0] for x in lengths)} long), text tokens: min {min(lengths)}, "
              f"median {sorted(lengths)[n // 2]}, max {max(lengths)}, truncated {truncated}; Q = {q}; "
              f"teacher_batch {p.teacher_batch}, token_budget {p.token_budget}; device {device}; "
              f"torch threads {torch.get_num_threads()}")
        print(f"naive fixed batches (original order): {len(naive)} batches, {naive_s:.2f} s, "
              f"{n / naive_s:.2f} prompts/s, padding efficiency {eff_naive:.3f}")
        print(f"token-budget packing:                 {len(packed)} batches, {packed_s:.2f} s, "
              f"{n / packed_s:.2f} prompts/s, padding efficiency {eff_packed:.3f}")
        print(f"whole pipeline (teacher half, packed): {pipeline_s:.2f} s, {n / pipeline_s:.2f} prompts/s, "
              f"{sum(lengths) / pipeline_s:.0f} text tokens/s")
        print(f"packing speedup vs naive:             {naive_s / packed_s:.2f}x  (target >= 1.5x)")
        print(f"end-to-end speedup vs naive forwards: {naive_s / pipeline_s:.2f}x")
        print(f"padding efficiency (packed):          {eff_packed:.3f}  (target >= 0.9)")
        print(f"pipeline overhead vs its own forwards: {100 * (pipeline_s / inside_s - 1):+.1f} %  (target <= 10 %; "
              f"{100 * (compute_s / inside_s - 1):+.1f} % before the disk writes)")
        print(f"pipeline vs separately timed forwards: {100 * (pipeline_s / packed_s - 1):+.1f} %  "
              "(includes load from other processes between the runs)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
