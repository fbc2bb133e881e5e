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
  # Through uv (pinned): the same packages as pip resolves (pip freeze compared), in seconds instead of a minute,
  # most of a fresh clone's install. No bytecode is compiled here: scripts/demo.sh and scripts/test.sh let Python
  # write each module's bytecode on its first import (see there). Compiling all of site-packages (torch's and
  # transformers' thousands of modules, most never imported) took 25 s of a fresh clone's 34 s setup.
  .venv/bin/pip install --quiet "uv==0.13.9"
  # torch pinned: on the CPU machines this project runs on, 2.13.0 is a local CPU wheel in the folder pip's
  # find-links names, while an unpinned torch would pull a multi-GB CUDA build. uv takes that folder when it is
  # given (3 s against pip's 19 s for torch alone); without one, pip installs torch first, as it always did, and
  # uv keeps the build it finds (it satisfies every requirement).
  links=$(.venv/bin/pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")
  if [ -n "$links" ] && [ -d "$links" ]; then
    find_links=(--find-links "$links")
  else
    find_links=()
    .venv/bin/pip install --quiet "torch==2.13.0"
  fi
  .venv/bin/python -m uv pip install --quiet --python .venv/bin/python "${find_links[@]}" \
    -e '.[test,cluster]' "torch==2.13.0"
  echo "$want" > "$stamp"
fi
