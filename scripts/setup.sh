#!/usr/bin/env bash
# Create .venv and install the project with its test extras. Re-running is cheap: it
# reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.gguf_assets-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet --upgrade pip
  # torch first and pinned: on the CPU machines this project runs on, 2.13.0 is a local CPU wheel,
  # while an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/pip install --quiet "torch==2.13.0"
  # The rest through uv (pinned): the same packages as pip resolves (pip freeze compared), in about 13 s instead
  # of about 60, most of a fresh clone's install. torch stays pip's: uv does not look at the local wheel, so it is
  # named again, pinned, and uv keeps the installed CPU build (it satisfies every requirement).
  # --compile-bytecode, as pip does: these machines set PYTHONDONTWRITEBYTECODE, so a module never compiled at
  # install is compiled again by every process that imports it (the suite took 906 s without it, 787 s with).
  .venv/bin/pip install --quiet "uv==0.13.9"
  .venv/bin/python -m uv pip install --quiet --compile-bytecode --python .venv/bin/python -e '.[test,cluster]' \
    "torch==2.13.0"
  echo "$want" > "$stamp"
fi
