"""ggk is the judge: its engine, built from the PyPI sdist, loads the files the demo project exported and computes,
for each prompt, the token ids, the student states and the conditioning the product computes in torch.

SD_DUMP_COND makes the engine write what it computed (ggk_run.py); the product's side is its own code: the
student's tokenizer and forward (lib/precompute/student.py), the trained checkpoint (lib/training) and the
torch-free evaluator (lib/output/gguf_eval.py). The command is the report's, with the image model's files (the
user's part) filled by tiny fixtures (ggk_fixture.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ggk_build import ggk_binary
from ggk_fixture import write_llada_dit, write_vae
from ggk_run import ADAPTER_LINE, engine_args, run_engine, with_prompt

from gguf_assets.lib.core import ggk_contract
from gguf_assets.lib.core.ggk_contract import emphasis_problem
from gguf_assets.lib.output import gguf_eval
from gguf_assets.lib.precompute.student import Student
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.training.checkpoints import load_final

# The README demo's project is their input (a whole pipeline: slow); its readers are one xdist group (conftest).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo")]

# The empty (CFG) prompt, escaped emphasis, a closing period (a piece of its own in ggk), two ordinary ones, and
# one where ggk's emphasis parser (a B inside a word) and its splitter ('S, 'd) differ from the obvious reading.
PROMPTS = ["", r"a \(red\) cat", "a lighthouse on a cliff at dusk.", "an old man reading a book",
           "a golden fox sleeping in a misty forest, watercolor, soft light",
           "an RGB eBay lamp by DnB, 4B; IT'S what I'd buy"]  # ggk's parser and splitter quirks


@pytest.fixture(scope="module")
def ggk() -> Path:
    return ggk_binary()


def centred_cosines(a: np.ndarray, b: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """Per query row: cos(a - centre, b - centre)."""
    a, b = (a - centre).astype(np.float64), (b - centre).astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def demo_in_ggk(demo_run, ggk, tmp_path_factory):
    """The demo project, its report's ggk command with fixture DiT and VAE, and the product's own pieces."""
    root, done = demo_run
    assert done.returncode == 0, done.stderr[-2000:]
    paths = ProjectPaths.of(root)
    settings = load_settings(root)
    report = json.loads(paths.report_json(settings).read_text())
    adapter = gguf_eval.load_adapter_gguf(root / report["ggk_files"]["adapter"])
    model, _ = load_final(root / json.loads(paths.adapter_manifest.read_text())["run_dir"])
    work = tmp_path_factory.mktemp("ggk")
    vision = report["ggk_files"]["vision_encoder"]
    semantic = 64
    if vision:
        import gguf

        semantic = next(int(t.shape[0]) for t in gguf.GGUFReader(root / vision).tensors
                        if t.name == "prior_token_embedding.weight")
    dit = write_llada_dit(work / "dit.gguf", cap_feat_dim=adapter.hparams["out_dim"], semantic_feat_dim=semantic)
    vae = write_vae(work / "tae.gguf")
    args = engine_args(report["ggk_command"], diffusion_model=str(dit), vae=str(vae))
    args[args.index("--vae")] = "--taesd"  # the fixture is a tiny autoencoder, which ggk takes by this flag
    student = Student(root / "materials" / "demo" / "student", settings, torch.device("cpu"))
    return {"root": root, "args": args, "adapter": adapter, "model": model, "student": student, "work": work,
            "report": report}


def test_the_reports_command_names_every_file_the_project_made(demo_in_ggk):
    args, files = demo_in_ggk["args"], demo_in_ggk["report"]["ggk_files"]
    for flag, role in (("--llm-adapter", "adapter"), ("--llm", "student"), ("--tokenizer-pack", "tokenizer_pack")):
        assert args[args.index(flag) + 1] == files[role]
    if files["vision_encoder"]:
        assert args[args.index("--llm_vision") + 1] == files["vision_encoder"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ggk_computes_what_the_product_computes(demo_in_ggk, ggk, prompt):
    d = demo_in_ggk
    dump = run_engine(ggk, with_prompt(d["args"], prompt), d["work"] / "dump", cwd=d["root"])
    assert dump.returncode == 0, dump.log[-3000:]
    assert "[X]" not in dump.log, dump.log[-3000:]  # no missing or misshapen tensor in any file, vision included
    line = ADAPTER_LINE.search(dump.log)
    hp = d["adapter"].hparams
    assert line and line["kind"] == ggk_contract.RESAMPLER_SEEDLESS
    assert (int(line["width"]), int(line["depth"]), int(line["queries"]), int(line["in_dim"]), int(line["out_dim"])) \
        == (hp["width"], hp["depth"], hp["query_count"], hp["in_dim"], hp["out_dim"])

    # The token ids: exactly the product's.
    ids, _ = d["student"].tokenize([prompt])
    assert dump.tokens == ids[0]

    # The student's states: the product's torch forward, within the f16 rounding of the GGUF's weights.
    with torch.inference_mode():
        ours = d["student"].model(input_ids=torch.tensor([ids[0]]), use_cache=False).last_hidden_state[0].numpy()
    scale = float(np.abs(ours).max())
    assert np.abs(dump.hidden - ours).max() <= 2e-2 * scale, np.abs(dump.hidden - ours).max()

    # The conditioning from those states: the torch checkpoint (per row, centred as the scores are) and the
    # torch-free evaluator that scores the report.
    model = d["model"]
    with torch.inference_mode():
        states = torch.from_numpy(dump.hidden)[None]
        torch_out = model.to_target_space(model(states, torch.ones(states.shape[:2], dtype=torch.bool)))[0].numpy()
    centre = model.target_centre.numpy()
    assert centred_cosines(dump.adapter_out, torch_out, centre).min() >= 0.9999
    assert np.abs(d["adapter"].forward(dump.hidden) - dump.adapter_out).max() <= 1e-3


def test_a_prompt_with_emphasis_aborts_ggk_and_the_product_says_so_first(demo_in_ggk, ggk):
    d = demo_in_ggk
    assert emphasis_problem("a (red) cat") and emphasis_problem(r"a \(red\) cat") is None
    dump = run_engine(ggk, with_prompt(d["args"], "a (red) cat"), d["work"] / "dump-emphasis", cwd=d["root"])
    assert dump.returncode != 0 and "GGML_ASSERT" in dump.log


def test_ggk_loads_the_sigvq_of_an_llada_image_pipeline_repo(demo_in_ggk, ggk, tmp_path):
    """The vision GGUF the product writes from a pipeline's sigvq/ folder (an LLaDA-Image teacher's: the tiny
    replica of llada_repo.py) loads in ggk's --llm_vision with no missing or misshapen tensor."""
    from llada_repo import build_tiny_llada_repo

    from gguf_assets.lib.output.vision import write_vision_gguf

    repo = build_tiny_llada_repo(tmp_path / "LLaDA-Image-Turbo")
    vision = write_vision_gguf(repo / "sigvq", tmp_path / "llada-vision.gguf", name="llada",
                               source="inclusionAI/LLaDA-Image-Turbo (sigvq/)", commit="0" * 40)
    d = demo_in_ggk
    args = list(d["args"])
    if "--llm_vision" in args:
        args[args.index("--llm_vision") + 1] = str(vision["path"])
    else:
        args += ["--llm_vision", str(vision["path"])]
    dump = run_engine(ggk, with_prompt(args, "a cat"), tmp_path / "dump", cwd=d["root"])
    assert dump.returncode == 0, dump.log[-3000:]
    assert "[X]" not in dump.log and "sigvq" in dump.log.lower(), dump.log[-3000:]


def test_ggk_loads_a_snapshot_of_the_run(demo_in_ggk, ggk, tmp_path):
    """`gguf-trainer snapshot` writes ggk's format: the engine loads a snapshot of the demo's run as its adapter
    and computes what the export's GGUF computes (the same final weights)."""
    from conftest import copy_project

    from gguf_assets.cli import main as trainer_main

    d = demo_in_ggk
    project = copy_project(d["root"], tmp_path / "demo-copy")
    assert trainer_main(["snapshot", str(project.root)]) == 0
    snapshot = next((project.root / "output").glob("*-step*.gguf"))
    args = list(d["args"])
    args[args.index("--llm-adapter") + 1] = str(snapshot)
    dump = run_engine(ggk, with_prompt(args, "a lighthouse on a cliff at dusk."), tmp_path / "dump", cwd=project.root)
    assert dump.returncode == 0 and "[X]" not in dump.log, dump.log[-3000:]
    assert ADAPTER_LINE.search(dump.log)
    exported = run_engine(ggk, with_prompt(d["args"], "a lighthouse on a cliff at dusk."), tmp_path / "dump-export",
                          cwd=d["root"])
    assert np.abs(dump.adapter_out - exported.adapter_out).max() <= 1e-6
