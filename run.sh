#!/usr/bin/env bash
# Set up (first time only) and run nanoqwen.
#   ./run.sh                     demo: stream one answer from Qwen/Qwen3-0.6B, or, when the hub can't be
#                                reached, from a random-weight model of the same shape made locally
#   ./run.sh serve               the OpenAI-compatible server and its chat page (it prints the URL), on that
#                                same model; likewise ./run.sh chat, generate and bench without --model
#   ./run.sh chat --model DIR    any nanoqwen command
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh

default_model() {
  local model=Qwen/Qwen3-0.6B
  if ! .venv/bin/python -c "from nanoqwen.model_loader.hub import resolve_model_path as r; r('$model')" 2>/dev/null; then
    model=models/qwen3-0.6b-random
    echo "The Hugging Face hub is not reachable: using random weights with the exact Qwen3-0.6B shape" \
         "(the text is gibberish, the speed is real)." >&2
    [ -f "$model/config.json" ] || .venv/bin/nanoqwen init-random "$model" --preset qwen3-0.6b >&2
  fi
  echo "$model"
}

if [ $# -eq 0 ]; then
  exec .venv/bin/nanoqwen generate --model "$(default_model)" --max-tokens 64 --no-think \
    --prompt "Give me a short introduction to large language models."
fi
case "$1" in
  serve|chat|generate|bench)
    case " $* " in
      *" --model "*|*" --model="*|*" -h "*|*" --help "*) ;;
      *) set -- "$1" --model "$(default_model)" "${@:2}" ;;
    esac ;;
esac
exec .venv/bin/nanoqwen "$@"
