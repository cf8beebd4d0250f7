#!/usr/bin/env bash
# Create .venv (once) and install nanoqwen into it, editable. Usage: scripts/setup.sh [--test]
# torch is pinned here: with no torch installed, an unpinned `torch` would pull a multi-GB CUDA build
# on CPU-only machines, while this pin takes the CPU wheel where one is provided (the normal wheel elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${NANOQWEN_TORCH_VERSION:-2.13.0}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
stamp=".venv/.installed${extras}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
  .venv/bin/python -m pip install -q -e ".${extras}"
  touch "$stamp"
fi
