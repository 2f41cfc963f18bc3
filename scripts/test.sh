#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The type check and the documentation (each uses one core, about 13 s) run beside the tests;
# their output follows the tests', and either failing fails the run.
echo "[test] type check (mypy, settings in pyproject.toml) and documentation with its API reference"
echo "[test] (sphinx -W: a broken reference fails; build/docs/index.html), beside the tests"
mkdir -p build
.venv/bin/python -m mypy > build/mypy.log 2>&1 & mypy=$!
TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/sphinx-build -q -E -W --keep-going -b html docs build/docs > build/sphinx.log 2>&1 & docs=$!
# Two workers (pytest-xdist; JUPYTER_RING_TEST_WORKERS=0 runs in this process): tests/conftest.py
# keeps together what must share a worker and orders the queue.
workers=${JUPYTER_RING_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
tests=0
.venv/bin/python -m pytest -q --durations=25 "${parallel[@]}" "$@" || tests=$?  # the slowest 25: where the suite's time goes
checks=0
wait "$mypy" || checks=1
echo "[test] mypy:"; cat build/mypy.log
wait "$docs" || checks=1
echo "[test] sphinx:"; cat build/sphinx.log
if [ "$checks" != 0 ]; then echo "[test] the type check or the documentation failed (above)"; exit 1; fi
exit "$tests"
