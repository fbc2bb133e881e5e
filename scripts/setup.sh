#!/usr/bin/env bash
# Create .venv and install the project with its test extras. Re-running is cheap: it
# reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
  # Without venv's own copy of pip (ensurepip: 3.5 of a fresh clone's 25 s of setup) where this Python's pip can
  # install into the venv (--python, pip 22.3 and newer); uv installs pip into .venv below.
  "$PYTHON" -m venv --without-pip .venv
  if ! "$PYTHON" -m pip --python .venv/bin/python --version >/dev/null 2>&1; then
    .venv/bin/python -m ensurepip --default-pip >/dev/null
  fi
fi
if [ -x .venv/bin/pip ]; then pip=(.venv/bin/pip); else pip=("$PYTHON" -m pip --python .venv/bin/python); fi
stamp=.venv/.gguf_assets-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # Through uv (pinned): the same packages as pip resolves (pip freeze compared), in seconds instead of a minute,
  # most of a fresh clone's install. Bytecode: see the end of this block.
  "${pip[@]}" install --quiet "uv==0.13.9"
  # torch pinned: on the CPU machines this project runs on, 2.13.0 is a local CPU wheel in the folder pip's
  # find-links names, while an unpinned torch would pull a multi-GB CUDA build. uv takes that folder when it is
  # given (3 s against pip's 19 s for torch alone); without one, pip installs torch first, as it always did, and
  # uv keeps the build it finds (it satisfies every requirement).
  links=$("${pip[@]}" config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")
  if [ -n "$links" ] && [ -d "$links" ]; then
    find_links=(--find-links "$links")
  else
    find_links=()
    "${pip[@]}" install --quiet "torch==2.13.0"
  fi
  .venv/bin/python -m uv pip install --quiet --python .venv/bin/python "${find_links[@]}" \
    -e '.[test,cluster]' "torch==2.13.0" pip
  # The peer app, an outside oracle for the LLaDA-Image teacher's QueryFormer and text projection
  # (gguf_assets_tests/lib/precompute/test_llada_teacher.py): only its torch modules are used, so none of its
  # dependencies (datasets, pyarrow, gguf-connector, ...) are installed. Apart, in .venv/oracle (the test puts it on
  # sys.path): installed into the venv, its own `gguf-trainer` script replaced ours. A venv that has it there from
  # before loses it, and gets our script back.
  if .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gguf_trainer") is None)'; then
    .venv/bin/python -m uv pip uninstall --quiet --python .venv/bin/python gguf-trainer
    .venv/bin/python -m uv pip install --quiet --python .venv/bin/python --no-deps --reinstall-package gguf_assets -e .
  fi
  rm -rf .venv/oracle
  .venv/bin/python -m uv pip install --quiet --python .venv/bin/python --no-deps --target .venv/oracle \
    "gguf-trainer==0.0.14"
  # Bytecode for what the pipeline, its servers and the tests import (3.5k of site-packages' 13.8k modules), written
  # by two processes that import it, one per core, whatever PYTHONDONTWRITEBYTECODE says (see scripts/test.sh): about
  # 12 s. Compiling all of site-packages took 25 s; leaving it all to the first imports made the suite's processes
  # that start together compile the same modules side by side.
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c \
    "import torch; from transformers.models.qwen3 import modeling_qwen3; from transformers.models.qwen3_moe import modeling_qwen3_moe" &
  models=$!
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c \
    "import gguf_assets.definitions, gguf_assets.orchestration.launching, dagster_webserver, dagster_postgres, dagster_celery, celery, playwright.sync_api, pytest, xdist"
  wait "$models"
  echo "$want" > "$stamp"
fi
