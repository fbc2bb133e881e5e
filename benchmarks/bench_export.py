"""Export and evaluation speed, as ratios against baselines measured in the same run.

1. Export: the export's cast (torch, once) and ``gguf_format.write_adapter_gguf`` (write while
   hashing from memory, fsync while re-reading and comparing every byte, rename) vs a raw
   atomic write of the same number of bytes (temp file, write, fsync, rename), alternated.
2. Evaluation: the numpy GGUF evaluator (``gguf_eval.evaluate_gguf``) vs the torch
   checkpoint's ``train.evaluate`` on the same val shards.

    .venv/bin/python benchmarks/bench_export.py            # adapter W=768, depth 4, Q=256, D=1024
    .venv/bin/python benchmarks/bench_export.py --quick    # a smaller one, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from gguf_assets.lib.core import atomic
from gguf_assets.lib.output import export, gguf_eval, gguf_format
from gguf_assets.lib.training import train
from gguf_assets.lib.training.adapter import MLP_RATIO, NORM_EPS, Adapter, AdapterShape


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
        adapter.target_mean.normal_()
        adapter.target_std.uniform_(0.5, 1.5)
    return adapter


def write_shards(folder: Path, shape: AdapterShape, *, shards: int, prompts: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(shards):
        shard = folder / f"{s:05d}"
        shard.mkdir(parents=True)
        lengths = rng.integers(4, 48, prompts)
        lengths[0] = 0  # the empty prompt
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        save_file({gguf_eval.TARGETS_TENSOR: rng.standard_normal((prompts, shape.query_rows, shape.target_dim))
                   .astype(np.float16)}, str(shard / gguf_eval.TEACHER_FILE))
        save_file({gguf_eval.HIDDEN_TENSOR: rng.standard_normal((int(offsets[-1]), shape.student_dim))
                   .astype(np.float16), gguf_eval.OFFSETS_TENSOR: offsets}, str(shard / gguf_eval.STUDENT_FILE))
        (shard / gguf_eval.PROMPTS_FILE).write_text(
            "".join(json.dumps({"text": "" if i == 0 else f"prompt {i}"}) + "\n" for i in range(prompts)))
        out.append(shard)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small adapter and shards")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--export-only", action="store_true", help="skip the evaluation comparison (minutes)")
    args = parser.parse_args()
    if args.quick:
        shape = AdapterShape(student_dim=256, query_rows=64, target_dim=256, width=256, depth=2, heads=4)
        n_shards, n_prompts = 2, 16
    else:
        shape = AdapterShape(student_dim=1024, query_rows=256, target_dim=1024, width=768, depth=4, heads=12)
        n_shards, n_prompts = 2, 48
    adapter = make_adapter(shape)
    tensors = {k: v.detach().float().numpy() for k, v in adapter.state_dict().items()}
    hparams = {**shape.to_dict(), "layer_norm_epsilon": NORM_EPS, "mlp_ratio": MLP_RATIO}
    provenance = {"student.repo": "bench/student", "student.commit": "0" * 40, "student.layer": -1,
                  "student.hidden_size": shape.student_dim, "teacher.repo": "bench/teacher",
                  "teacher.commit": "1" * 40, "training.steps": 1, "training.seed": 0,
                  "training.val_centred_cosine": 0.0}
    print(f"adapter {shape}, {sum(t.size for t in tensors.values()) / 1e6:.1f}M values; torch threads "
          f"{torch.get_num_threads()}")

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp)
        gguf_file = root / "adapter.gguf"
        # What export_adapter does with the trained weights: cast once (torch), then write verified.
        def do_export() -> None:
            gguf_format.write_adapter_gguf(gguf_file, tensors=export._cast_once(adapter.state_dict()),
                                           hparams=hparams, provenance=provenance, name="bench")

        do_export()
        size = gguf_file.stat().st_size
        payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        # Alternated, one of each per round: this VM's write speed drifts by 30 % from one second to
        # the next, so each round's ratio compares two measurements taken under the same conditions.
        pairs = [(best_of(1, do_export), best_of(1, lambda: atomic.write_bytes(root / "raw.bin", payload)))
                 for _ in range(max(3, 3 * args.repeats))]
        export_s, raw_s = min(p[0] for p in pairs), min(p[1] for p in pairs)
        ratios = sorted(e / r for e, r in pairs)
        print(f"\nexport: {size / 1e6:.1f} MB GGUF in {export_s:.3f} s; raw atomic write of the same bytes "
              f"{raw_s:.3f} s (best of {len(pairs)} alternated rounds)")
        print(f"  ratio export / raw write = {ratios[len(ratios) // 2]:.2f}x median over rounds "
              f"(quartiles {ratios[len(ratios) // 4]:.2f}x-{ratios[3 * len(ratios) // 4]:.2f}x; best vs best "
              f"{export_s / raw_s:.2f}x; {size / 1e6 / export_s:.0f} MB/s vs {size / 1e6 / raw_s:.0f} MB/s)")

        if args.export_only:
            return
        shards = write_shards(root / "val", shape, shards=n_shards, prompts=n_prompts)
        numpy_result: dict = {}
        torch_result: dict = {}
        numpy_s = best_of(args.repeats, lambda: numpy_result.update(gguf_eval.evaluate_gguf(gguf_file, shards)))
        torch_s = best_of(args.repeats, lambda: torch_result.update(train.evaluate(
            adapter, shards, device=torch.device("cpu"), cosine_weight=0.5)))
        n = numpy_result["n_prompts"]
        print(f"\nevaluation on {n} val prompts ({n_shards} shards): numpy GGUF {numpy_s:.3f} s "
              f"({n / numpy_s:.1f} prompts/s), torch checkpoint {torch_s:.3f} s ({n / torch_s:.1f} prompts/s)")
        print(f"  ratio numpy / torch = {numpy_s / torch_s:.2f}x")
        print(f"  val centred cosine: numpy {numpy_result['val_centred_cosine']:.6f}, torch "
              f"{torch_result['val_centred_cosine']:.6f}, difference "
              f"{abs(numpy_result['val_centred_cosine'] - torch_result['val_centred_cosine']):.2e}")


if __name__ == "__main__":
    main()
