#!/usr/bin/env bash
# nanoqwen on a CUDA GPU in one run: setup, GPU correctness checks, benchmarks against transformers.
#
#   bench/gpu.sh                      # every stage, within GPU_SH_BUDGET seconds (default 570)
#   bench/gpu.sh setup kernels parity # only these stages (setup always runs first)
#
# Stages: setup (a Python with CUDA torch, the packages), checkpoint (a random Qwen3-0.6B-shaped checkpoint),
# kernels (paged decode kernels vs the reference, also replayed from a CUDA graph; bench/gpu_check.py),
# parity (greedy tokens: CUDA graphs vs eager vs the gather path vs transformers; bench/gpu_check.py): in bf16 on
# the benchmarks' checkpoint, where rows may part at near ties, and in float32 on one of weights N(0, 0.08), where
# they must not (bf16 logits of such weights are large, so one rounding step of them is 0.06-0.3 nats),
# moe (the same in float32 on a tiny random Qwen3-MoE checkpoint; no graphs there: its expert dispatch syncs with
# the host; bf16 on so small a model is mostly near ties), features (on tiny float32 models, against CPU: logprobs
# and penalties, seeded sampling, speculative decoding, prefix-cache hits, forks, embeddings and scores,
# structured outputs when llguidance is there; bench/gpu_check.py),
# decode (prefill and batch-1/16 decode: nanoqwen with graphs, with --enforce-eager, transformers;
# bench/bench_model.py), profile (where a decode step's time goes: phases, kernels a step; bench/gpu_profile.py),
# throughput (256 requests, prompts and outputs 100-1024; bench/bench_throughput.py).
#
# The whole run stays within GPU_SH_BUDGET seconds (default 570): each stage gets its own timeout, cut to what
# is left. The throughput stage, the longest, runs last and gets what is left.
# Everything goes to $OUT (default bench/.gpu-results) as it comes: gpu.log (all output), summary.md (versions,
# check results and the benchmark tables, ready for BENCHMARKS.md), BENCHMARKS.md (this copy's, with the GPU
# sections written).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/.gpu-results}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
BUDGET=${GPU_SH_BUDGET:-570}
START=$SECONDS
STAGES=${*:-checkpoint kernels parity moe features decode profile throughput}
SUMMARY="$OUT/summary.md"
MODEL=bench/.models/qwen3-0.6b-random-bf16
# float32 parity: weights N(0, 0.08), so that greedy tokens are not near ties
PARITY_MODEL=bench/.models/qwen3-0.6b-random-bf16-std0.08
MOE_MODEL=bench/.models/qwen3-moe-tiny-random-bf16  # weights N(0, 0.08) too
FEATURE_MODELS=bench/.models/features-tiny  # tiny/, embedding-tiny/, reranker-tiny/: float32, N(0, 0.08)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
PIP_FLAGS=(-q --disable-pip-version-check --retries 1 --timeout 20)  # fail fast on a machine without network

say() { echo "[gpu.sh $((SECONDS - START))s] $*"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }

# run_stage NAME TIMEOUT CMD...: the stage's own timeout, cut to the time left; its stdout also to $OUT/NAME.out
run_stage() {
  local name=$1 limit=$2 left status
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then
    say "SKIP $name: the ${BUDGET}s budget is spent"
    echo "| $name | skipped (budget spent) | |" >>"$OUT/stages.md"
    return 1
  fi
  ((limit > left)) && limit=$left
  say "stage $name (timeout ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" | tee "$OUT/$name.out"
  status=${PIPESTATUS[0]}
  local what="ok"
  ((status == 124 || status == 137)) && what="timed out after ${limit}s"
  ((status != 0 && status != 124 && status != 137)) && what="failed (exit $status)"
  say "stage $name: $what in $((SECONDS - t0))s"
  echo "| $name | $what | $((SECONDS - t0)) s |" >>"$OUT/stages.md"
  return "$status"
}

# --- setup: a Python whose torch sees the GPU --------------------------------------------------------------
has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate" && {
    PY=$candidate
    break
  }
done
if [ -z "$PY" ]; then
  say "no Python with a CUDA-enabled torch: installing the normal torch wheel into .venv-gpu"
  python3 -m venv .venv-gpu && timeout 300 .venv-gpu/bin/python -m pip install "${PIP_FLAGS[@]}" torch
  has_cuda_torch .venv-gpu/bin/python && PY=.venv-gpu/bin/python
fi
if [ -z "$PY" ]; then
  say "FATAL: no torch that sees a CUDA GPU (nvidia-smi below)"
  nvidia-smi || true
  exit 1
fi
# nanoqwen runs from this folder (PYTHONPATH); install only what is missing, keeping the CUDA torch as it is.
if ! "$PY" -c 'import tokenizers, safetensors, jinja2, tqdm, numpy, huggingface_hub, transformers, triton' 2>/dev/null; then
  say "installing missing packages (pip install -e .[test]; torch is kept)"
  timeout 300 "$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[test]" || say "pip install failed: continuing with what is there"
fi
"$PY" -c 'import tokenizers, safetensors, jinja2, tqdm, numpy, huggingface_hub' || {
  say "FATAL: nanoqwen's dependencies are missing"
  exit 1
}
VERSIONS=$("$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.get_device_name(0)} ({p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}) · "
      f"CUDA {torch.version.cuda} · torch {torch.__version__} · triton {v('triton')} · flash-attn {v('flash_attn')} · "
      f"transformers {v('transformers')} · Python {platform.python_version()}")
EOF
)
say "python: $PY"
say "versions: $VERSIONS"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null || true
echo "| stage | result | time |" >"$OUT/stages.md"
echo "|---|---|---:|" >>"$OUT/stages.md"

# --- stages ------------------------------------------------------------------------------------------------
if want checkpoint || want parity || want decode || want profile || want throughput; then
  if [ ! -f "$MODEL/config.json" ]; then
    run_stage checkpoint 120 "$PY" -m nanoqwen init-random "$MODEL" --preset qwen3-0.6b --dtype bfloat16
  fi
fi
want kernels && run_stage kernels 90 "$PY" bench/gpu_check.py kernels
if want parity; then
  if [ ! -f "$PARITY_MODEL/config.json" ]; then
    run_stage parity-checkpoint 120 "$PY" -m nanoqwen init-random "$PARITY_MODEL" --preset qwen3-0.6b \
      --dtype bfloat16 --std 0.08
  fi
  run_stage parity 100 "$PY" bench/gpu_check.py parity --model "$MODEL"
  run_stage parity-fp32 100 "$PY" bench/gpu_check.py parity --model "$PARITY_MODEL" --dtype float32
fi
if want moe; then
  if [ ! -f "$MOE_MODEL/config.json" ]; then
    run_stage moe-checkpoint 60 "$PY" -m nanoqwen init-random "$MOE_MODEL" --preset qwen3-moe-tiny \
      --dtype bfloat16 --std 0.08
  fi
  run_stage moe 90 "$PY" bench/gpu_check.py parity --model "$MOE_MODEL" --dtype float32
fi
if want features; then
  for preset in tiny embedding-tiny reranker-tiny; do
    if [ ! -f "$FEATURE_MODELS/$preset/config.json" ]; then
      "$PY" -m nanoqwen init-random "$FEATURE_MODELS/$preset" --preset "$preset" --dtype float32 --std 0.08 \
        >/dev/null || say "init-random $preset failed"
    fi
  done
  run_stage features 120 "$PY" bench/gpu_check.py features --model "$FEATURE_MODELS"
fi
# (both benchmarks use $MODEL, their default checkpoint, when not given --model)
want decode && run_stage decode 170 "$PY" bench/bench_model.py --device cuda --write
want profile && run_stage profile 120 "$PY" bench/gpu_profile.py
want throughput && run_stage throughput 300 "$PY" bench/bench_throughput.py --gpu-workload --device cuda \
  --hf-batch-size 64 --hf-time-budget 100 --write

# --- summary -----------------------------------------------------------------------------------------------
{
  echo "## GPU run of $(date -u +%F) · $VERSIONS"
  echo
  echo "\`bench/gpu.sh\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)'), $((SECONDS - START)) s."
  echo
  cat "$OUT/stages.md"
  for name in kernels parity parity-fp32 moe features; do
    if [ -f "$OUT/$name.out" ]; then
      echo
      echo "Checks ($name):"
      echo
      grep -E '^(PASS|FAIL|SKIP|time) ' "$OUT/$name.out" | sed 's/^/    /'
    fi
  done
  for name in decode profile throughput; do
    if [ -s "$OUT/$name.out" ]; then
      echo
      if [ "$name" = profile ]; then  # (plain text: fenced)
        printf '```text\n%s\n```\n' "$(cat "$OUT/$name.out")"
      else
        cat "$OUT/$name.out"
      fi
    fi
  done
} >"$SUMMARY"
cp BENCHMARKS.md "$OUT/BENCHMARKS.md" 2>/dev/null || true
say "done in $((SECONDS - START))s; summary in $SUMMARY:"
cat "$SUMMARY"
