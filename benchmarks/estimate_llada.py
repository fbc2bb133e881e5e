"""The memory estimate for an LLaDA-Image-Turbo-shaped teacher, before any download: the tiny replica's layout
(gguf_assets_tests/llada_repo.py: model_index.json, remote code, the parts' configs) with the real model's sizes
written into the configs and no weights, so the estimate builds the LLaDA2-MoE text encoder on the meta device by
the repo's code (materials.trust_remote_code on) and sizes the QueryFormer and the text projection from their
configs.

    .venv/bin/python benchmarks/estimate_llada.py [--quick]

Prints `gguf-trainer estimate --gpus ...`'s lines on 1 x 24, 1 x 32 + 1 x 6 (the seed's RTX 5090 + RTX 4050) and
1 x 80 GiB, with 64 GiB of CPU RAM. Building the 16B-parameter backbone on the meta device (256 experts in each of
19 layers) takes tens of seconds on 2 cores. ``--quick`` (the suite's test) plans a cut-down shape instead: 4 layers of
16 experts, on the same three GPU sets.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "gguf_assets_tests")]

GIB = 2**30
# LLaDA2.0-mini's shape (the 16B-A1.4B LLaDA2-MoE that LLaDA-Image-Turbo's text_encoder/ holds), and the
# pipeline's QueryFormer and text projection (DESIGN.md §10; the peer app's defaults).
TEXT_ENCODER = dict(vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=256,
                    num_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=512, first_k_dense_replace=1,
                    max_position_embeddings=8192)
QUERYFORMER = dict(hidden_size=2048, num_queries=256, num_attention_heads=16, intermediate_size=8192, norm_eps=1e-6,
                   num_hidden_layers=1)
TEXT_PROJECTION = dict(hidden_size=2048, intermediate_size=8960, num_attention_heads=32, norm_eps=1e-6,
                       num_hidden_layers=6, projection_dim=2560)
QUICK = dict(vocab_size=32768, num_hidden_layers=4, num_experts=16)  # the same parts, a few GiB
GPU_SETS = ([24.0], [32.0, 6.0], [80.0])
CPU_RAM = 64 * GIB


def shaped_repo(root: Path, *, quick: bool = False) -> Path:
    from llada_repo import build_tiny_llada_repo

    repo = build_tiny_llada_repo(root / "LLaDA-Image-Turbo")
    for weights in repo.rglob("*.safetensors"):
        weights.unlink()
    (repo / "text_encoder" / "model.safetensors.index.json").unlink(missing_ok=True)
    encoder = {**TEXT_ENCODER, **(QUICK if quick else {})}
    for part, sizes in (("text_encoder", encoder), ("queryformer", QUERYFORMER),
                        ("text_projection", TEXT_PROJECTION)):
        config = repo / part / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **sizes}, indent=2))
    return repo


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a cut-down shape (the suite's test)")
    quick = parser.parse_args().quick
    os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="hf-modules-"))
    from gguf_assets.lib.planning.estimate import estimate_lines
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        repo = shaped_repo(Path(tmp), quick=quick)
        project = Path(tmp) / "project"
        project.mkdir()
        settings = Settings.model_validate({"materials": {"teacher": str(repo), "trust_remote_code": True},
                                            "precompute": {"device": "cuda"}})
        for sizes in GPU_SETS:
            start = time.perf_counter()
            lines = estimate_lines(ProjectPaths.of(project), settings, gpu_sizes_gib=sizes,
                                   available_cpu_bytes=CPU_RAM)
            print(f"--gpus {','.join(f'{s:g}' for s in sizes)} ({time.perf_counter() - start:.0f} s)")
            print("\n".join(line for line in lines if "teacher" in line))


if __name__ == "__main__":
    main()
