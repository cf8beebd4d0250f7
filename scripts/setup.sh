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
# The chat page's browser tests drive the system's Chromium (Playwright's own browser download needs the
# internet). Installed here where apt-get can; where it cannot, those tests report themselves skipped.
if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  { $sudo apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "scripts/setup.sh: could not install chromium with apt-get; the chat page's browser tests will be skipped" >&2
fi
