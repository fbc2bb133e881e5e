#!/usr/bin/env bash
# Set up, then run the test suite.
#   bash scripts/test.sh [-q]          the whole suite, as CI runs it: five processes on both cores
#                                      (pytest-xdist), then the tests marked `serial` (they time a user-facing bound) alone
#   bash scripts/test.sh --fast        the fast loop: the tests marked neither slow nor serial, in three processes
#   bash scripts/test.sh ARGS...       pytest ARGS as given, in one process (e.g. a test path, -k NAME)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Python's default, which some machines' environments turn off (PYTHONDONTWRITEBYTECODE): each module's bytecode is
# written into .venv (or the checkout) on its first import, so the next process loads it compiled instead of compiling
# it again (on such a machine the suite took 906 s when every process compiled its imports, 787 s with them compiled).
unset PYTHONDONTWRITEBYTECODE
# ggk's engine, the outside reader every exported file is checked by (gguf_assets_tests/ggk/): built from its PyPI
# sdist once per machine and ggk version, cached outside the clone (~/.cache/gguf_assets; about 4 minutes the first
# time on 2 cores, nothing after). Built here, before the tests, so no test's time limit covers the build.
.venv/bin/python gguf_assets_tests/ggk/ggk_build.py
# Five test processes on two cores: many tests wait (on a server to start, a stalled write, a daemon's tick, a
# browser, Postgres or Redis restarting), and the other processes fill those waits. With three, the machine still sat
# idle 103 and 124 of its about 1,350 CPU seconds (2026-12-03, mostly in the first minutes, when the long waiting
# tests run side by side); with four, 35 of 1,272 then, but 126 of 1,157 on 2026-12-05 once the cluster tests (real
# Postgres and Redis, restarted under a run) ran beside the demo (640 s); with five, 32 of 1,224 (606 s; measured
# with scripts/suite_cpu.py). The fast loop has none of the waiting tests: three processes there (89 s, against 94
# and 102 s with four). GGUF_ASSETS_TEST_WORKERS changes either.
WORKERS=${GGUF_ASSETS_TEST_WORKERS:-5}
if [ "${1:-}" = "--fast" ]; then
  shift
  OMP_NUM_THREADS=1 exec .venv/bin/python -m pytest -n "${GGUF_ASSETS_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder -m "not slow and not serial" "$@"
fi
whole=1
for arg in "$@"; do
  case "$arg" in -q|-v|-qq|-vv|-x) ;; *) whole=0 ;; esac
done
if [ "$whole" = 1 ]; then
  # The tests come longest first (conftest.py, durations.json) and each worker takes the next one as it frees up
  # (it holds at most three queued), except that a module with a costly module fixture is one xdist_group, which one
  # worker takes whole (--dist loadgroup; --no-loadscope-reorder keeps conftest.py's order). (worksteal handed the
  # first half, so all the long tests, to one worker, which then ran them one after another.)
  # One torch/OpenMP thread per process: the workers, each with its pipelines' subprocesses, already fill both
  # cores, and oversubscribed OpenMP teams spin against each other (two demo pipelines side by side: 38 s each
  # with the default threads, 22 s with one).
  OMP_NUM_THREADS=1 .venv/bin/python -m pytest -n "$WORKERS" --dist loadgroup --no-loadscope-reorder -m "not serial" "$@"
  # Only the modules that mark a test pytest.mark.serial: collecting every module again cost the serial part about
  # 4 of its 19 s.
  mapfile -t serial_modules < <(grep -rl --include='test_*.py' 'pytest.mark.serial' gguf_assets_tests | sort)
  exec .venv/bin/python -m pytest -m serial "${serial_modules[@]}" "$@"
fi
exec .venv/bin/python -m pytest "$@"
