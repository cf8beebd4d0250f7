#!/usr/bin/env bash
# Set up (first time only) and run the tests: ruff, the import layers (lint-imports), then pytest. Extra
# arguments go to pytest, e.g. `./test.sh -m "not slow"` for a fast run, `./test.sh tests/core`.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/lint-imports
.venv/bin/python -m pytest -rs "$@"
# On a CPU with more than AVX2 (and a full run: no arguments), the parity, engine, CPU-path, int4 and GGUF tests
# again with torch and nanoqwen limited to AVX2, so the paths an AVX2-only CPU takes (float32 compute from
# 16-bit weights for many rows, the AVX2 kernels without VNNI) are tested on every machine.
if [ $# -eq 0 ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "== the same CPU limited to AVX2: parity, engine, CPU-path, int4 and GGUF tests =="
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    .venv/bin/python -m pytest tests/models/test_parity.py tests/engine/test_llm_engine.py \
      tests/ops/cpu/test_matmul_path.py tests/quantization/test_int4.py tests/quantization/test_int8_group.py \
      tests/model_loader/test_gguf.py
  # the kernels of a checkpoint's own formats (float32, float16 and two-level scales, grouped int8, 5- and 6-bit, FP8)
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    .venv/bin/python -m pytest tests/ops/cpu/test_kernels.py -k "float32_scales or float16_scales or two_level or int8_group or int5 or int6 or fp8"
fi
