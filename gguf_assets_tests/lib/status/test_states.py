"""The status engine's words: what a running stage shows."""

from gguf_assets.lib.core.lock import HolderRecord, RunningRun
from gguf_assets.lib.status.states import StageState, with_running


def test_status_shows_the_stage_a_run_works_on_as_running():
    status = [StageState("train_shards", "current"), StageState("adapter", "stale", "training.steps 400 → 600"),
              StageState("gguf", "blocked", "waits for adapter")]
    running = HolderRecord(running=RunningRun(run_id="1a2b3c4d5e6f", job="train_export_evaluate",
                                              assets=("adapter", "gguf", "eval_report")))
    shown = with_running(status, running)
    assert shown[1] == StageState("adapter", "running", "run 1a2b3c4d of train_export_evaluate; was stale: "
                                  "training.steps 400 → 600")
    assert shown[0] == status[0] and shown[2] == status[2]  # the rest wait as before
    assert with_running(status, None) == status and with_running(status, HolderRecord(pid=1)) == status


def test_the_status_engine_and_every_stage_module_load_no_torch():
    """`status` reads records and fingerprints only: each stage's own module (settings, fingerprint, "is it
    current") and the engine above them import no torch, transformers or dagster (they cost seconds), nor a
    stage's builder (the shards' is lib/precompute/shards.py; its facts are shards_run.py's)."""
    import subprocess
    import sys

    modules = ["gguf_assets.lib.status.states", "gguf_assets.lib.status.stages",
               "gguf_assets.lib.status.verify_project", "gguf_assets.lib.planning.estimate",
               "gguf_assets.lib.status.pace", "gguf_assets.lib.planning.time_estimate",
               "gguf_assets.lib.materials.materials_run", "gguf_assets.lib.corpus.corpus_run",
               "gguf_assets.lib.precompute.shards_run", "gguf_assets.lib.training.training_run",
               "gguf_assets.lib.output.export_run", "gguf_assets.lib.output.report_run"]
    builders = {"gguf_assets.lib.precompute.shards"}
    code = (f"import sys, {', '.join(modules)}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'dagster'}), "
            f"sorted(set(sys.modules) & {builders!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[] []", done.stdout + done.stderr
