"""The memory estimate for a real-sized pair, before any download: a Qwen3-MoE teacher with the shape of
Qwen3-30B-A3B's config.json and a Qwen3 student with Qwen3-0.6B's, written as config-only folders (no
weights: the estimate builds them on the meta device) plus the teacher's [256, D] query rows.

    .venv/bin/python benchmarks/estimate_large.py

Prints `gguf-trainer estimate`'s lines for the trainer8 recipe (1024 x 6) and where the teacher would go,
per device, under sequential and balanced placement on the seed's machine (an RTX 5090 with 32 GiB and
a 6 GiB RTX 4050) and on two 80 GiB GPUs.
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
MACHINES = {"the seed's RTX 5090 + RTX 4050": {0: 32 * GIB, 1: 6 * GIB}, "two 80 GiB GPUs": {0: 80 * GIB, 1: 80 * GIB}}
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
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status.estimate import estimate_lines, placement_text, teacher_placements

    with tempfile.TemporaryDirectory() as tmp:
        project = build_pair(Path(tmp))
        paths, settings = ProjectPaths.of(project), load_settings(project)
        print("estimate (trainer8 adapter 1024 x 6, Qwen3-30B-A3B-shaped teacher, Qwen3-0.6B-shaped student):")
        print("\n".join(estimate_lines(paths, settings)))
        for machine, gpus in MACHINES.items():
            print(f"teacher placement on {machine} (budgets: auto, {CPU_RAM // GIB} GiB RAM):")
            placements = teacher_placements(paths.resolve_local(settings.materials.teacher), settings,
                                            free_gpu_bytes=gpus, available_cpu_bytes=CPU_RAM)
            for strategy, summary in placements.items():
                print(f"  {strategy:<10} {placement_text(summary)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
