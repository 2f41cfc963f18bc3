#!/usr/bin/env bash
# Set up .venv and run the quickstart notebook on 2 CPU ranks, printing every cell's output.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m jupyter_ring.demo "$@"
