#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] type check (mypy, settings in pyproject.toml)"
.venv/bin/python -m mypy
echo "[test] documentation and API reference (sphinx -W: a broken reference fails; build/docs/index.html)"
TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/sphinx-build -q -E -W --keep-going -b html docs build/docs
exec .venv/bin/python -m pytest -q --durations=25 "$@"  # the slowest 25: where the suite's time goes
