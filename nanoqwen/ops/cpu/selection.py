"""Which matmul path this CPU runs a 16-bit model on, and which rows nanoqwen's own kernels take: measured
once per machine, not guessed from the CPU's name (nanoqwen/ops/cpu/matmul.py says what each choice means).

`select_matmul_path`: NANOQWEN_CPU_MATMUL=bf16|float32 forces the path; otherwise a probe times a bf16 and a
float32 matmul of a prompt-sized shape (about a second, once) and the result is cached per CPU model, CPU flags,
torch version and thread count in ~/.cache/nanoqwen/cpu-matmul.json. A second probe, cached beside it, times
nanoqwen's bf16 gemv kernel against what those rows would take otherwise (torch's F.linear, or upcast_linear) at 1
to 64 rows and sets how many rows (decode steps, short prompt chunks) the gemv kernels take, on any CPU
(NANOQWEN_CPU_GEMV=0|1 forces them off or on). Where the CPU has AMX tiles, a fourth times int4 products on them
against int4_gemv at 2 to 64 rows and sets from how many rows int4 layers use them, a fifth bf16 products on them
against torch's and a sixth int8 ones against int8_gemv (select_int4_amx, select_bf16_amx, select_int8_amx;
NANOQWEN_CPU_AMX=0|1 forces them off or on; the one-call
decode step, which has no MatmulPath, takes the last choice made in the process: the tiles compute the same bits,
so only the speed differs). On the float32 path a third, also cached, times nanoqwen's bf16_gemm against
upcast_linear on a prompt-sized product: where it is faster, it takes the rows past the gemv kernels' (the same
arithmetic with the weights converted inside the product). The probes and their cache are
nanoqwen/ops/cpu/probes.py; this module decides from what they measure. The engine calls it once and builds its
model with the result (nanoqwen/worker/kernel_selection.py); nothing here is kept but that int4 AMX choice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from nanoqwen.ops.cpu import build as cpu_build
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu import probes as cpu_probes
from nanoqwen.ops.cpu.matmul import GEMV_MAX_ROWS, PATHS, MatmulPath

logger = logging.getLogger("nanoqwen")
# The gemv kernels take a row count while their bf16 product reaches this share of the path's alternative
# (torch's F.linear; on the float32 path, from UPCAST_MIN_ROWS rows on, upcast_linear): with them come the
# one-call C++ decode step and the int8 kernel, which gain more than that loses where torch's one-row bf16
# kernel ties with nanoqwen's (bench/bench_gemv.py and bench/bench_decode_step.py measure both).
GEMV_MIN_SHARE = 0.8
AMX_ENV = "NANOQWEN_CPU_AMX"  # 0: int4, int8 and bf16 products never on AMX tiles; 1: from 2 rows on; else measured
SLOW_BF16 = 0.5  # bf16 below half of float32's speed: compute in float32


def select_matmul_path(cache_dir: Path | None = None) -> MatmulPath:
    """This machine's path for 16-bit matmuls over many rows (forced, cached, or measured now and
    cached), and up to how many rows nanoqwen's gemv kernels take: NANOQWEN_CPU_GEMV=1|0 forces them
    on (up to GEMV_MAX_ROWS) or off; otherwise they take every row count of cpu_probes.GEMV_PROBE_ROWS, from 1
    up, at which they read a weight matrix at least GEMV_MIN_SHARE as fast as torch's bf16 F.linear
    (measured once per machine, cached beside the path; on the float32 path, from UPCAST_MIN_ROWS rows
    on, against what those rows would take: bf16_gemm where _select_gemm chose it, else upcast_linear).
    torch's few-row kernel is far below the read bandwidth on AVX2-only CPUs, and on some native-bf16
    ones too, where its many-row kernel overtakes nanoqwen's at a few rows; a float32 product
    overtakes it at some 100 rows."""
    choice = _select_path(cache_dir)
    wanted = os.environ.get("NANOQWEN_CPU_GEMV", "auto")
    if wanted == "0" or not cpu_kernels.available():
        return choice
    choice = select_int4_amx(choice, cache_dir)
    if choice.path == "bf16":
        choice = select_int8_amx(select_bf16_amx(choice, cache_dir), cache_dir)
    if choice.path == "float32":
        choice = _select_gemm(choice, wanted == "1", cache_dir)
    if wanted == "1":
        return replace(choice, gemv_max_rows=GEMV_MAX_ROWS,
                       gemv_reason=f"{cpu_kernels.bf16_dot_instructions()}; NANOQWEN_CPU_GEMV=1")
    # {rows: [own GB/s, the alternative's GB/s]} (JSON keys are strings)
    # Keyed by the kernels' build too: a changed kernel is measured again.
    against = choice.path + (" + gemm" if choice.gemm else "")
    what = f"gemv rows against the {against} path, kernels {cpu_build.build_digest()}"

    def measure() -> dict:
        return cpu_probes.gemv_probe(choice.path, choice.gemm)

    speeds = {int(m): v for m, v in cpu_probes.cached(cache_dir, what, measure).items()}
    gemv_max_rows = 0
    for rows, (own, theirs) in sorted(speeds.items()):
        if own < GEMV_MIN_SHARE * theirs:
            break
        gemv_max_rows = rows
    shown = ", ".join(f"{m}: {own:.1f} vs {theirs:.1f}" for m, (own, theirs) in sorted(speeds.items()))
    return replace(choice, gemv_max_rows=gemv_max_rows, gemv_reason=(
        f"{cpu_kernels.bf16_dot_instructions()}; measured GB/s by rows, own vs without them: {shown}"))


def select_int4_amx(choice: MatmulPath, cache_dir: Path | None = None) -> MatmulPath:
    """From how many rows on int4 products run on AMX tiles (cpu_kernels.int4_amx), where the CPU has them
    (cpu_kernels.amx_int8_available()): NANOQWEN_CPU_AMX=0 never, =1 from 2 rows on; otherwise the fewest rows of
    cpu_probes.AMX_PROBE_ROWS from which the tiles were measured faster than int4_gemv at every larger count
    (cpu_probes.int4_amx_probe, once per machine and build of the kernels, cached); none where they never were."""
    rows, reason = _tiles_choice(cpu_kernels.amx_int8_available(), "int4 on AMX tiles against int4_gemv",
                                 cpu_probes.int4_amx_probe, "int4_gemv", cache_dir)
    chosen = replace(choice, int4_amx_min_rows=rows, int4_amx_reason=reason) if rows else choice
    # the one-call decode step (csrc/module.cpp) has no MatmulPath: it takes the process's choice
    cpu_kernels.set_int4_amx_min_rows(chosen.int4_amx_min_rows)
    return chosen


def select_bf16_amx(choice: MatmulPath, cache_dir: Path | None = None) -> MatmulPath:
    """select_int4_amx's choice for bf16 products on AMX-BF16 tiles (cpu_kernels.bf16_amx, up to
    matmul.AMX_MAX_ROWS rows, where cpu_kernels.amx_bf16_available()), measured against torch's F.linear
    (cpu_probes.bf16_amx_probe)."""
    rows, reason = _tiles_choice(cpu_kernels.amx_bf16_available(), "bf16 on AMX tiles against F.linear",
                                 cpu_probes.bf16_amx_probe, "torch", cache_dir)
    return replace(choice, bf16_amx_min_rows=rows, bf16_amx_reason=reason) if rows else choice


def select_int8_amx(choice: MatmulPath, cache_dir: Path | None = None) -> MatmulPath:
    """select_int4_amx's choice for int8 products on AMX-BF16 tiles (cpu_kernels.int8_amx, up to matmul.AMX_MAX_ROWS
    rows, where cpu_kernels.amx_bf16_available()), measured against int8_gemv (cpu_probes.int8_amx_probe)."""
    rows, reason = _tiles_choice(cpu_kernels.amx_bf16_available(), "int8 on AMX tiles against int8_gemv",
                                 cpu_probes.int8_amx_probe, "int8_gemv", cache_dir)
    return replace(choice, int8_amx_min_rows=rows, int8_amx_reason=reason) if rows else choice


def _tiles_choice(available: bool, what: str, probe: Callable[[], dict], against: str,
                  cache_dir: Path | None) -> tuple[int, str]:
    """(fewest rows on the tiles, 0 for never; why): NANOQWEN_CPU_AMX=0 or no tiles never, =1 from 2 rows on,
    else measured by probe (cached under `what` and the kernels' build)."""
    forced = os.environ.get(AMX_ENV, "auto")
    if forced == "0" or not available:
        return 0, ""
    if forced == "1":
        return 2, f"{AMX_ENV}=1"
    speeds = {int(m): v for m, v in cpu_probes.cached(cache_dir, f"{what}, kernels {cpu_build.build_digest()}",
                                                      probe).items()}
    shown = ", ".join(f"{m}: {amx:.1f} vs {theirs:.1f}" for m, (amx, theirs) in sorted(speeds.items()))
    return amx_min_rows(speeds), f"measured GB/s by rows, tiles vs {against}: {shown}"


def amx_min_rows(speeds: dict[int, tuple[float, float]]) -> int:
    """The fewest rows from which the tiles were faster at every measured count ({rows: (tiles, int4_gemv)}), 0
    where they were not at the most rows measured."""
    fewest = 0
    for rows, (amx, theirs) in sorted(speeds.items(), reverse=True):
        if amx <= theirs:
            break
        fewest = rows
    return fewest


def _select_gemm(choice: MatmulPath, forced: bool, cache_dir: Path | None) -> MatmulPath:
    """Whether the float32 path's products over many rows go through nanoqwen's bf16_gemm: forced, or
    measured faster than upcast_linear (once per machine and build of the kernels, cached)."""
    if forced:
        return replace(choice, gemm=True, gemm_reason="NANOQWEN_CPU_GEMV=1")
    what = f"gemm against upcast_linear, kernels {cpu_build.build_digest()}"
    speeds = cpu_probes.cached(cache_dir, what, cpu_probes.gemm_probe)
    return replace(choice, gemm=speeds["own"] > speeds["upcast"], gemm_reason=(
        f"measured {speeds['own']:.0f} vs {speeds['upcast']:.0f} GFLOP/s through upcast_linear"))


def _select_path(cache_dir: Path | None) -> MatmulPath:
    forced = os.environ.get("NANOQWEN_CPU_MATMUL", "auto")
    if forced in PATHS:
        return MatmulPath(forced, "forced by NANOQWEN_CPU_MATMUL")
    if forced != "auto":
        logger.warning("NANOQWEN_CPU_MATMUL=%s is not one of auto, %s: measuring instead",
                       forced, ", ".join(PATHS))
    found = cpu_probes.cached(cache_dir, "matmul", lambda: asdict(probe()))
    kept = {f.name for f in fields(MatmulPath)} - {"gemv_max_rows", "gemv_reason", "gemm", "gemm_reason",
                                                   "int4_amx_min_rows", "int4_amx_reason",
                                                   "bf16_amx_min_rows", "bf16_amx_reason",
                                                   "int8_amx_min_rows", "int8_amx_reason"}
    return MatmulPath(**{k: v for k, v in found.items() if k in kept})


def probe() -> MatmulPath:
    """Time a bf16 and a float32 matmul of a prompt-sized shape (cpu_probes.PROBE_SHAPE) and choose."""
    bf16, f32 = cpu_probes.matmul_gflops(torch.bfloat16), cpu_probes.matmul_gflops(torch.float32)
    path = "bf16" if bf16 >= SLOW_BF16 * f32 else "float32"
    return MatmulPath(path, f"measured: bf16 {bf16:.1f}, float32 {f32:.1f} GFLOP/s",
                      round(bf16, 1), round(f32, 1))
