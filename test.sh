#!/usr/bin/env bash
# Set up (first time only) and run the tests: ruff, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
