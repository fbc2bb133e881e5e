"""The memory estimate for a real-sized pair, before any download: a Qwen3-MoE teacher with the shape of
Qwen3-30B-A3B's config.json and a Qwen3 student with Qwen3-0.6B's, written as config-only folders (no
weights: the estimate builds them on the meta device) plus the teacher's [256, D] query rows.

    .venv/bin/python benchmarks/estimate_large.py

Prints `gguf-trainer estimate --gpus 24`'s lines for the trainer8 recipe (1024 x 6), then where the teacher would
go, per device, under sequential and balanced placement, and the speed that costs (scaled from the seed's
measurement), on 1 x 24, 2 x 24, 1 x 80 and 1 x 141 GiB (`--gpus` of each), with 128 GiB of CPU RAM.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
# The architectures' shapes as their hub config.json files give them (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-0.6B).
QWEN3_MOE_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
                         tie_word_embeddings=False)
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True)
QUERY_ROWS = 256
GPU_SETS = ([24], [24, 24], [80], [141])  # GiB per GPU, as `--gpus` takes them
CPU_RAM = 128 * GIB


def build_pair(root: Path) -> Path:
    """A project folder whose materials are the two config-only model folders; returns the project folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3MoeConfig

    from gguf_assets.lib.demo.demo import demo_settings
    from gguf_assets.lib.project.settings import Settings, replace, write_project_file

    teacher, student = root / "models" / "qwen3-moe-30b-a3b", root / "models" / "qwen3-0.6b"
    Qwen3MoeConfig(**QWEN3_MOE_30B_A3B).save_pretrained(teacher)
    Qwen3Config(**QWEN3_0_6B).save_pretrained(student)
    save_file({"query_rows": torch.zeros(QUERY_ROWS, QWEN3_MOE_30B_A3B["hidden_size"], dtype=torch.bfloat16)},
              str(teacher / "query_rows.safetensors"))
    reference = Settings().training  # trainer8: 1024 x 6
    settings = replace(demo_settings(), materials={"teacher": str(teacher), "student": str(student)},
                       precompute={"mock_teacher": False, "device": "auto"},
                       training={k: getattr(reference, k) for k in ("width", "depth", "heads")})
    project = root / "project"
    project.mkdir(parents=True)
    write_project_file(project, settings)
    return project


def main() -> int:
    from gguf_assets.lib.planning.estimate import SPEED_NOTE, estimate_lines, named_gpus, placement_lines
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        project = build_pair(Path(tmp))
        paths, settings = ProjectPaths.of(project), load_settings(project)
        print("estimate (trainer8 adapter 1024 x 6, Qwen3-30B-A3B-shaped teacher, Qwen3-0.6B-shaped student):")
        sizes_lines = estimate_lines(paths, settings, gpu_sizes_gib=GPU_SETS[0], available_cpu_bytes=CPU_RAM)
        print("\n".join(sizes_lines[:4]))  # the parts and the peak; the placements per GPU set follow
        for sizes in GPU_SETS:
            print(f"--gpus {','.join(map(str, sizes))} ({len(sizes)} x {sizes[0]} GiB, {CPU_RAM // GIB} GiB RAM):")
            for line in placement_lines(paths, settings, named_gpus(sizes), available_cpu_bytes=CPU_RAM):
                if line != SPEED_NOTE:  # printed once, below
                    print(f"  {line}")
        print(f"  {SPEED_NOTE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
