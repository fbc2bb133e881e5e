"""Training runs: list, compare, label, go back to and delete them (`gguf-trainer runs`, the studio's Runs panel).

Every training fingerprint is a run: its folder ``checkpoints/<fingerprint>/`` holds its checkpoints, best/ and
final/ (lib/training/checkpoints.py), how its last training session ended (session.json), the label a user gave
it (label.txt) and its own exported GGUF and report (export/, lib/output/kept.py). Everything here is derived
from those files and the settings snapshots they name (lib/project/settings_history.py): there is no list of
runs beside them.

- A run's **name** is its TensorBoard run's (lib/telemetry/curves_log.run_name): shape, steps, learning rate and
  the fingerprint's start, e.g. ``64x1-400steps-lr0.004-e82b5612``; stable, as it is made of what the run is.
- **current**: the run whose GGUF and report are in the output folder (checkpoints/final.json names it).
- **Use** (``use_run``) puts the settings that decide a run's result back into project.yaml (in place, comments
  kept, refused when the file changed since it was read), then makes its kept GGUF and report current again.
- **Delete** (``delete_run``) renames the run's folder aside, then removes it; never the current run's.
"""
