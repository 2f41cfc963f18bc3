#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] type check (mypy, settings in pyproject.toml)"
.venv/bin/python -m mypy
echo "[test] documentation and API reference (sphinx -W: a broken reference fails; build/docs/index.html)"
TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/sphinx-build -q -E -W --keep-going -b html docs build/docs
# Two workers (pytest-xdist; JUPYTER_RING_TEST_WORKERS=0 runs in this process): tests/conftest.py
# keeps together what must share a worker and sends the longest groups out first.
workers=${JUPYTER_RING_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q --durations=25 "${parallel[@]}" "$@"  # the slowest 25: where the suite's time goes
