#!/usr/bin/env bash
# Set up, then run the whole pipeline through Dagster on the built-in tiny demo project.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode written on first import, as Python does by default (why: scripts/test.sh).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/gguf-trainer demo "${1:-demo-project}" "${@:2}"
