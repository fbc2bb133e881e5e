#!/usr/bin/env bash
# Set up, then run the test suite.
#   bash scripts/test.sh [-q]          the whole suite, as CI runs it: on both cores (pytest-xdist), then the
#                                      tests marked `serial` (benchmarks whose rules compare timings) alone
#   bash scripts/test.sh ARGS...       pytest ARGS as given, in one process (e.g. -m "not slow", a test path)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
whole=1
for arg in "$@"; do
  case "$arg" in -q|-v|-qq|-vv|-x) ;; *) whole=0 ;; esac
done
if [ "$whole" = 1 ]; then
  # worksteal: an idle process takes queued tests from the busy one, so the long tests do not pile up at the end
  .venv/bin/python -m pytest -n 2 --dist worksteal -m "not serial" "$@"
  exec .venv/bin/python -m pytest -m serial "$@"
fi
exec .venv/bin/python -m pytest "$@"
