"""What `gguf-trainer status` reads, as the shards grow; against hashing the shards, as status once did.

A demo project (real materials and corpus, built by the library) gets N shards of random
tensors in the real on-disk format, with the records the precompute writes; then

- status: ``gguf-trainer status`` run in this process; its bytes read are the change in the
  process's ``rchar`` (/proc/self/io), its time is wall time;
- baseline: sha256 of every shard file, which is what each status cost before the stamps.

Then project.yaml's load (``load_settings``: every stage's process, `status` and the studio's polls read it, several
times each) with libyaml's parser, against PyYAML's pure-Python one, which it used before, in the same run.

The teacher half here holds 256 query rows x 128 dims in f16 (64 KiB a prompt); a real
teacher's rows are 2048 or more wide, so real shards are larger and the ratio smaller still.

    .venv/bin/python benchmarks/bench_status.py            # 50, 200 and 800 shards of 8 prompts
    .venv/bin/python benchmarks/bench_status.py --quick    # 20 and 80 shards (the test runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

from gguf_assets.lib.core import atomic
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
from gguf_assets.lib.demo.demo import build_demo_materials, demo_settings
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.precompute.shards import _write_half
from gguf_assets.lib.precompute.shards_run import data_file, plan_shards
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import replace, write_project_file

QUERY_ROWS, TARGET_DIM, STUDENT_DIM, TOKENS_PER_PROMPT = 256, 128, 64, 24
SHARD_PROMPTS = 8
MAX_READ_FRACTION = 0.01  # the bound: status reads under 1 % of the shard bytes


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def build_project(root: Path, materials_root: Path, shards: int, *, shard_prompts: int = SHARD_PROMPTS,
                  query_rows: int = QUERY_ROWS, target_dim: int = TARGET_DIM) -> ProjectPaths:
    """A demo project whose train split fills ``shards`` shards, all written and current."""
    import shutil

    shutil.copytree(materials_root, root / "materials" / "demo")
    settings = replace(demo_settings(steps=10, mock_teacher=True),
                       corpus={"train_prompts": shards * shard_prompts, "val_prompts": shard_prompts,
                               "allow_fewer": False},
                       precompute={"shard_size": shard_prompts, "val_shard_size": shard_prompts})
    write_project_file(root, settings)
    paths = ProjectPaths.of(root)
    materials = resolve_materials(paths, settings)
    build_corpus(paths, settings, materials, fingerprint=corpus_fingerprint(paths, settings, materials))
    gen = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for plan in plan_shards(paths, settings, materials, split):
            n = len(plan.prompts)
            folder = plan.folder(paths)
            folder.mkdir(parents=True, exist_ok=True)
            targets = torch.randn(n, query_rows, target_dim, generator=gen).half()
            hidden = torch.randn(n * TOKENS_PER_PROMPT, STUDENT_DIM, generator=gen).bfloat16()
            offsets = torch.arange(0, n * TOKENS_PER_PROMPT + 1, TOKENS_PER_PROMPT, dtype=torch.int64)
            _write_half(folder, "teacher", {"targets": targets},
                        {"fingerprint": plan.fingerprints["teacher"], "prompts": n})
            _write_half(folder, "student", {"hidden": hidden, "offsets": offsets,
                                            "token_ids": torch.zeros(len(hidden), dtype=torch.int32)},
                        {"fingerprint": plan.fingerprints["student"], "prompts": n})
    return paths


def shard_files(paths: ProjectPaths) -> list[Path]:
    return [data_file(folder, half) for folder in sorted(paths.root.glob("shards/*/*"))
            for half in ("teacher", "student")]


def measure(paths: ProjectPaths) -> dict:
    from gguf_assets.cli import commands as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):  # once before: module imports are not the status's reads
        cli.cmd_status(argparse.Namespace(project=str(paths.root)))
    began_bytes, began = rchar(), time.perf_counter()
    with contextlib.redirect_stdout(out):
        cli.cmd_status(argparse.Namespace(project=str(paths.root)))
    status_s, status_bytes = time.perf_counter() - began, rchar() - began_bytes
    shown = out.getvalue()
    if "train_shards current" not in " ".join(shown.split()):
        raise RuntimeError(f"the shards should be current:\n{shown}")

    files = shard_files(paths)
    began = time.perf_counter()
    for f in files:
        atomic.sha256_file(f)
    return {"status_s": status_s, "status_bytes": status_bytes, "baseline_s": time.perf_counter() - began,
            "shard_bytes": sum(f.stat().st_size for f in files)}


def settings_load_ms(paths: ProjectPaths, loops: int = 50) -> tuple[float, float]:
    """Milliseconds per ``load_settings`` of this project: as it reads the file, and with the pure-Python loader."""
    import yaml

    from gguf_assets.lib.project import settings

    def per_load() -> float:
        settings.load_settings(paths.root)
        began = time.perf_counter()
        for _ in range(loops):
            settings.load_settings(paths.root)
        return (time.perf_counter() - began) / loops * 1000

    fast = per_load()
    chosen, settings._FAST_LOADER = settings._FAST_LOADER, yaml.SafeLoader
    try:
        return fast, per_load()
    finally:
        settings._FAST_LOADER = chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 and 80 shards")
    parser.add_argument("--shards", type=int, nargs="*", help="shard counts to try")
    args = parser.parse_args(argv)
    counts = args.shards or ([20, 80] if args.quick else [50, 200, 800])
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        materials = Path(tmp) / "demo-materials"
        # Enough distinct prompts for the largest project (the corpus dedupes and needs them all).
        build_demo_materials(materials, seed=0, n_prompts=max(counts) * SHARD_PROMPTS * 11 // 10 + 200)
        for n in counts:
            paths = build_project(Path(tmp) / f"p{n}", materials, n)
            r = measure(paths)
            fraction = r["status_bytes"] / r["shard_bytes"]
            failed |= fraction >= MAX_READ_FRACTION
            rows.append((n, r["shard_bytes"] / 2**20, r["status_bytes"] / 2**10, 100 * fraction, r["status_s"],
                         r["baseline_s"], r["status_s"] / r["baseline_s"]))
        load_ms, python_loader_ms = settings_load_ms(paths)
    print(f"{'shards':>7} {'shard MiB':>10} {'status read KiB':>16} {'% of shards':>12} {'status s':>9} "
          f"{'hash-all s':>11} {'status/hash-all':>16}")
    for n, mib, kib, pct, status_s, base_s, ratio in rows:
        print(f"{n:>7} {mib:>10.1f} {kib:>16.1f} {pct:>11.3f}% {status_s:>9.3f} {base_s:>11.3f} {ratio:>16.3f}")
    per_shard = [r[4] / r[0] for r in rows]
    print(f"status seconds per shard: {', '.join(f'{x * 1000:.2f} ms' for x in per_shard)} "
          f"(hash-all reads every byte: its time grows with the bytes)")
    print(f"project.yaml load: {load_ms:.2f} ms; with the pure-Python YAML loader {python_loader_ms:.2f} ms; "
          f"ratio {load_ms / python_loader_ms:.3f}")
    if failed:
        print(f"FAIL: status read {MAX_READ_FRACTION:.0%} or more of the shard bytes", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
