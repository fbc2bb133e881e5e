"""Export and evaluation speed, as ratios against baselines measured in the same run.

1. Export: the export's fold and cast (torch, once: ``export.ggk_tensors``, the standardization folded into
   out_proj as ggk's file holds it) and ``gguf_format.write_adapter_gguf`` (write while
   hashing from memory, fsync while re-reading and comparing every byte, rename) vs a raw
   atomic write of the same number of bytes (temp file, write, fsync, rename), alternated.
   Always the full-size adapter (W=768, depth 4, Q=256, D=1024: 80 MB, a fraction of a second):
   a small file would measure the fixed costs (the GGUF header, the re-read's parse) instead.
2. Evaluation: the numpy GGUF evaluator (``gguf_eval.evaluate_gguf``) vs the torch
   checkpoint's ``train.evaluate`` on the same val shards (both centred on the checkpoint's rows' train mean),
   and how far their scores differ.

3. The f16 check: at the seed's shape (width 1024, depth 6, 256 x 2560 targets read from Qwen3-0.6B's
   1024-dim states) with --val-prompts val prompts (1,000, the seed's), the adapter file as the export writes it
   with its f16 check (``export.write_adapter_file``: the check reads the input peaks the validation of the
   weights recorded in their meta.json, lib/training/input_peaks.py) against the write alone (fold, cast,
   write), alternated. The record is made here by ``measure_peaks`` over --measure-prompts of the prompts (the
   export's time does not depend on its values). That measurement is also what the export does without a
   record (a run from before records): its time per prompt gives the whole check's; a profiled forward gives what
   recording the peaks adds to a validation. Before the records the export measured every val prompt on the
   CPU: about 1.1 s a prompt at this shape on 2 cores, 18 minutes for 1,000.

Both run on one thread (torch: --threads; numpy's BLAS: OPENBLAS_NUM_THREADS, unless set).

The rules (exit status 1 when one fails): the export takes at most 10x the raw write (median of
the rounds; it measures 1.5-3x, the higher with both cores busy elsewhere), the numpy
evaluation at most 5x the torch one (it measures 0.8-1.9x), and the two val centred cosines
differ by less than 1e-3 (the eval_report check's bound; they differ by about 1e-6); the export with its f16
check takes at most 10x the write alone (median of the rounds).

    .venv/bin/python benchmarks/bench_export.py            # the evaluation with the full-size adapter (minutes)
    .venv/bin/python benchmarks/bench_export.py --quick    # the evaluation with a small one, each timing fewer
                                                           # times (the test runs this)
    .venv/bin/python benchmarks/bench_export.py --export-only  # the export alone, the f16 check at the seed's shape
"""

from __future__ import annotations

import os

# numpy's BLAS fixes its thread count when it loads, so it is set before anything imports numpy: one
# thread, as torch gets (--threads), unless the environment says otherwise. Teams of two or more stall
# on a busy shared machine (a numpy evaluation of 10 s instead of 0.2 s), which swamps the ratios.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from gguf_assets.lib.core import atomic  # noqa: E402
from gguf_assets.lib.output import export, gguf_eval, gguf_format  # noqa: E402
from gguf_assets.lib.telemetry.hardware import resolve_device  # noqa: E402
from gguf_assets.lib.training import train  # noqa: E402
from gguf_assets.lib.training.adapter import MLP_RATIO, Adapter, AdapterShape  # noqa: E402
from gguf_assets.lib.training.input_peaks import INPUT_PEAKS, PeakRecorder, measure_peaks, peaks_record  # noqa: E402
from gguf_assets.lib.training.train_data import student_batches  # noqa: E402

# ggk's resampler: heads of 64, so 12 and 4 heads.
FULL_SHAPE = AdapterShape(student_dim=1024, query_rows=256, target_dim=1024, width=768, depth=4)
QUICK_SHAPE = AdapterShape(student_dim=256, query_rows=64, target_dim=256, width=256, depth=2)
# trainer8 on LLaDA-Image: Qwen3-0.6B's states, 256 query rows of 2560, width 1024, depth 6.
SEED_SHAPE = AdapterShape(student_dim=1024, query_rows=256, target_dim=2560, width=1024, depth=6)
SEED_VAL_PROMPTS = 1000
VAL_SHARD_SIZE = 500  # precompute.val_shard_size's default
CPU_MEASURE_PROMPTS = 8  # --measure-prompts on a CPU (0.6-1.1 s a prompt at the seed's shape); on a GPU, all of them
MAX_EXPORT_RATIO = 10.0  # export / raw atomic write, median of the rounds
MAX_CHECK_RATIO = 10.0   # export with its f16 check / the write alone, median of the rounds
MAX_EVAL_RATIO = 5.0     # numpy GGUF evaluation / torch checkpoint evaluation
AGREEMENT = 1e-3         # |numpy - torch| val centred cosine (the eval_report check's bound)


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def make_adapter(shape: AdapterShape) -> Adapter:
    torch.manual_seed(0)
    adapter = Adapter(shape).eval()
    with torch.no_grad():
        adapter.target_centre.normal_()
        adapter.target_std.uniform_(0.5, 1.5)
        adapter.loss_std.uniform_(0.5, 1.5)
    return adapter


def write_shards(folder: Path, shape: AdapterShape, *, shards: int, prompts: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(shards):
        shard = folder / f"{s:05d}"
        shard.mkdir(parents=True)
        # ggk's template gives every prompt tokens, the empty one (prompt 0) too: about 20 of them.
        lengths = rng.integers(4, 48, prompts)
        lengths[0] = 20
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        save_file({gguf_eval.TARGETS_TENSOR: rng.standard_normal((prompts, shape.query_rows, shape.target_dim))
                   .astype(np.float16)}, str(shard / gguf_eval.TEACHER_FILE))
        save_file({gguf_eval.HIDDEN_TENSOR: rng.standard_normal((int(offsets[-1]), shape.student_dim))
                   .astype(np.float16), gguf_eval.OFFSETS_TENSOR: offsets}, str(shard / gguf_eval.STUDENT_FILE))
        (shard / gguf_eval.PROMPTS_FILE).write_text(
            "".join(json.dumps({"text": "" if i == 0 else f"prompt {i}"}) + "\n" for i in range(prompts)))
        out.append(shard)
    return out


def write_student_shards(folder: Path, shape: AdapterShape, *, prompts: int, seed: int = 0) -> list[Path]:
    """Val shards' student halves, all the f16 check reads: ggk's template gives a prompt 16-80 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 80, prompts)
    out = []
    for s, start in enumerate(range(0, prompts, VAL_SHARD_SIZE)):
        shard = folder / f"{s:05d}"
        shard.mkdir(parents=True)
        counts = lengths[start:start + VAL_SHARD_SIZE]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        hidden = np.random.default_rng([seed, s]).standard_normal((int(offsets[-1]), shape.student_dim),
                                                                  dtype=np.float32)
        save_file({gguf_eval.HIDDEN_TENSOR: hidden.astype(np.float16), gguf_eval.OFFSETS_TENSOR: offsets},
                  str(shard / gguf_eval.STUDENT_FILE))
        out.append(shard)
    return out


def provenance_of(shape: AdapterShape) -> dict:
    return {"conditioning": "llada-image", "student.repo": "bench/student", "student.commit": "0" * 40,
            "student.hidden_size": shape.student_dim, "teacher.repo": "bench/teacher",
            "teacher.commit": "1" * 40, "training.steps": 1, "training.planned_steps": 1,
            "training.checkpoint": "final", "training.seed": 0, "training.val_centred_cosine": 0.0,
            "trainer": export.TRAINER}


def export_gguf(adapter: Adapter, shape: AdapterShape, path: Path) -> None:
    """What export_adapter does with the trained weights: fold and cast once (torch), then write verified."""
    hparams = gguf_format.hparams_of(student_dim=shape.student_dim, query_rows=shape.query_rows,
                                     target_dim=shape.target_dim, width=shape.width, depth=shape.depth,
                                     mlp_ratio=MLP_RATIO)
    gguf_format.write_adapter_gguf(path, tensors=export._cast_once(export.ggk_tensors(adapter)), hparams=hparams,
                                   provenance=provenance_of(shape), name="bench")


def values(adapter: Adapter) -> float:
    return sum(t.numel() for t in adapter.state_dict().values()) / 1e6


# The ops PeakRecorder adds to a forward (the adapter's own forward runs none of them).
RECORDER_OPS = ("aten::amax", "aten::amin", "aten::neg", "aten::maximum", "aten::masked_fill", "aten::masked_fill_",
                "aten::bitwise_not")


def recorder_share(adapter: Adapter, folders: list[Path], device: torch.device) -> float:
    """The share of a recorded forward's time (one batch) that PeakRecorder's own ops take: what recording the peaks
    adds to a validation. Profiled, not timed against a plain forward: on a shared machine two passes differ by more
    than the recorder costs."""
    from torch.profiler import ProfilerActivity, profile

    states, mask = next(student_batches(folders[0], device=device))
    on_gpu = device.type == "cuda"
    with PeakRecorder(adapter), torch.inference_mode(), profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as profiled:
        adapter.to(device)(states, mask)
    events = profiled.key_averages()
    spent = [(e.key, e.self_device_time_total if on_gpu else e.self_cpu_time_total) for e in events]
    return sum(t for key, t in spent if key in RECORDER_OPS) / sum(t for _, t in spent)


def f16_check(root: Path, shape: AdapterShape, *, prompts: int, measure_prompts: int, device: torch.device,
              rounds: int) -> tuple[str, bool]:
    """Section 3: prints the figures; returns the rule's text and whether it holds."""
    adapter = make_adapter(shape)
    folders = write_student_shards(root / "f16-val", shape, prompts=prompts)
    measured = write_student_shards(root / "f16-measured", shape, prompts=measure_prompts)
    print(f"\nf16 check at width {shape.width}, depth {shape.depth} (Q {shape.query_rows}, D {shape.target_dim}, "
          f"student dim {shape.student_dim}): {values(adapter):.1f}M values")
    print(f"val prompts: {prompts:,}, shards: {len(folders)}")
    print(f"device of the measurement: {device}")
    share = recorder_share(adapter, measured, device)  # also the device's first kernels and allocations
    peaks: dict = {}
    measure_s = best_of(rounds, lambda: peaks.update(measure_peaks(adapter, measured, device=device)))
    adapter.to("cpu")
    # What a trained run's final/meta.json holds: the record of the validation that judged the weights.
    meta = {"shape": shape.to_dict(), INPUT_PEAKS: peaks_record(peaks, folders)}
    gguf_file = root / "f16-check.gguf"

    def with_check() -> None:
        export.write_adapter_file(gguf_file, adapter, meta, provenance=provenance_of(shape), name="bench",
                                  val_folders=folders, device=device)

    pairs = [(best_of(1, lambda: export_gguf(adapter, shape, gguf_file)), best_of(1, with_check))
             for _ in range(rounds)]
    write_s, check_s = min(p[0] for p in pairs), min(p[1] for p in pairs)
    ratios = sorted(c / w for w, c in pairs)
    median = ratios[len(ratios) // 2]
    per_prompt = measure_s / measure_prompts
    print(f"  write alone: {write_s:.3f} s; export with its f16 check: {check_s:.3f} s (best of {rounds})")
    print(f"  ratio export with f16 check / write alone = {median:.2f}x median over {rounds} rounds")
    print(f"  measuring without a record: {measure_s:.3f} s for {measure_prompts:,} prompts "
          f"({per_prompt:.4f} s a prompt, best of {rounds})")
    whole = write_s + per_prompt * prompts
    print(f"  so about {whole:.1f} s for {prompts:,} prompts: {whole / write_s:.1f}x the write alone")
    print(f"  recording the peaks in a validation: {100 * share:.1f} % of its forward (profiled)")
    return f"export with its f16 check / write alone {median:.2f}x <= {MAX_CHECK_RATIO:g}x", median <= MAX_CHECK_RATIO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the evaluation with a small adapter and shards")
    parser.add_argument("--repeats", type=int,
                        help="timed runs of each evaluation (the best counts) and export rounds / 3 (default 3, "
                             "--quick 1: 3 export rounds)")
    parser.add_argument("--export-only", action="store_true", help="skip the evaluation comparison (minutes)")
    parser.add_argument("--val-prompts", type=int, default=None,
                        help=f"val prompts of the f16 check (default {SEED_VAL_PROMPTS:,}, the seed's; with --quick "
                             "32)")
    parser.add_argument("--measure-prompts", type=int, default=None,
                        help=f"of those, how many the f16 check's own measurement runs over (default: all on a GPU, "
                             f"{CPU_MEASURE_PROMPTS} on a CPU)")
    parser.add_argument("--device", default="auto", help="where the f16 check measures: auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0 = torch's default); 1 matches numpy's one BLAS thread "
                             "(OPENBLAS_NUM_THREADS, set before numpy loads). On a small shared machine teams of 2+ "
                             "threads stall on busy neighbours, which swamps the ratios with noise.")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    eval_shape, n_shards, n_prompts = (QUICK_SHAPE, 2, 16) if args.quick else (FULL_SHAPE, 2, 48)
    adapter = make_adapter(FULL_SHAPE)
    print(f"export adapter {FULL_SHAPE}, {values(adapter):.1f}M values; torch threads {torch.get_num_threads()}, "
          f"OPENBLAS_NUM_THREADS {os.environ.get('OPENBLAS_NUM_THREADS')}")
    checks: list[tuple[str, bool]] = []

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp)
        gguf_file = root / "adapter.gguf"

        export_gguf(adapter, FULL_SHAPE, gguf_file)
        size = gguf_file.stat().st_size
        payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        # Alternated, one of each per round: this VM's write speed drifts by 30 % from one second to
        # the next, so each round's ratio compares two measurements taken under the same conditions.
        pairs = [(best_of(1, lambda: export_gguf(adapter, FULL_SHAPE, gguf_file)),
                  best_of(1, lambda: atomic.write_bytes(root / "raw.bin", payload)))
                 for _ in range(max(3, 3 * args.repeats))]
        export_s, raw_s = min(p[0] for p in pairs), min(p[1] for p in pairs)
        ratios = sorted(e / r for e, r in pairs)
        median = ratios[len(ratios) // 2]
        print(f"\nexport: {size / 1e6:.1f} MB GGUF in {export_s:.3f} s; raw atomic write of the same bytes "
              f"{raw_s:.3f} s (best of {len(pairs)} alternated rounds)")
        print(f"  ratio export / raw write = {median:.2f}x median over rounds "
              f"(quartiles {ratios[len(ratios) // 4]:.2f}x-{ratios[3 * len(ratios) // 4]:.2f}x; best vs best "
              f"{export_s / raw_s:.2f}x; {size / 1e6 / export_s:.0f} MB/s vs {size / 1e6 / raw_s:.0f} MB/s)")
        checks.append((f"export / raw write {median:.2f}x <= {MAX_EXPORT_RATIO:g}x", median <= MAX_EXPORT_RATIO))
        adapter, payload = None, b""  # the big adapter and its bytes are no longer needed

        if not args.export_only:
            adapter = make_adapter(eval_shape)
            if eval_shape != FULL_SHAPE:
                gguf_file = root / "eval-adapter.gguf"
                export_gguf(adapter, eval_shape, gguf_file)
            shards = write_shards(root / "val", eval_shape, shards=n_shards, prompts=n_prompts)
            numpy_result: dict = {}
            torch_result: dict = {}
            centre = adapter.target_centre.numpy()  # what the report reads from the checkpoint (training_centre)
            numpy_s = best_of(args.repeats, lambda: numpy_result.update(gguf_eval.evaluate_gguf(gguf_file, shards,
                                                                                               centre)))
            torch_s = best_of(args.repeats, lambda: torch_result.update(train.evaluate(
                adapter, shards, device=torch.device("cpu"), cosine_weight=0.5)))
            n = numpy_result["n_prompts"]
            difference = abs(numpy_result["val_centred_cosine"] - torch_result["val_centred_cosine"])
            print(f"\nevaluation adapter {eval_shape}, {values(adapter):.1f}M values")
            print(f"evaluation on {n} val prompts ({n_shards} shards): numpy GGUF {numpy_s:.3f} s "
                  f"({n / numpy_s:.1f} prompts/s), torch checkpoint {torch_s:.3f} s ({n / torch_s:.1f} prompts/s)")
            print(f"  ratio numpy / torch = {numpy_s / torch_s:.2f}x")
            print(f"  val centred cosine: numpy {numpy_result['val_centred_cosine']:.6f}, torch "
                  f"{torch_result['val_centred_cosine']:.6f}, difference {difference:.2e}")
            checks.append((f"numpy / torch {numpy_s / torch_s:.2f}x <= {MAX_EVAL_RATIO:g}x",
                           numpy_s / torch_s <= MAX_EVAL_RATIO))
            checks.append((f"difference {difference:.2e} < {AGREEMENT:g}", difference < AGREEMENT))

        device = resolve_device(args.device)
        prompts = args.val_prompts or (32 if args.quick else SEED_VAL_PROMPTS)
        measure_prompts = min(prompts, args.measure_prompts or (prompts if device.type == "cuda"
                                                                  else CPU_MEASURE_PROMPTS))
        check_rule = f16_check(root, QUICK_SHAPE if args.quick else SEED_SHAPE, prompts=prompts,
                               measure_prompts=measure_prompts, device=device, rounds=max(3, args.repeats))

    ok = all(passed for _, passed in checks)
    print(f"\nrule: {' and '.join(text for text, _ in checks)} -> {'ok' if ok else 'FAIL'}")
    print(f"rule: {check_rule[0]} -> {'ok' if check_rule[1] else 'FAIL'}")
    return 0 if ok and check_rule[1] else 1


if __name__ == "__main__":
    sys.exit(main())
