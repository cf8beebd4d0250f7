"""The measurements nanoqwen/ops/cpu/selection.py chooses a CPU's matmul path by, and their cache.

Each probe times two ways of computing the same product on this machine, the two alternating so that both see
the same machine (a shared machine's speed drifts within seconds), and returns plain numbers; selection.py
decides from them. Each result is measured once per CPU model, CPU flags, torch CPU capability, torch version
and thread count (and, for the kernels' probes, per build of nanoqwen's kernels) and kept in
~/.cache/nanoqwen/cpu-matmul.json (`cached`):

- matmul_gflops: torch's bf16 and float32 matmul on PROBE_SHAPE (which path);
- gemv_probe: nanoqwen's bf16 gemv kernel against what the rows take without it, by row count (how many rows
  the gemv kernels take);
- gemm_probe: nanoqwen's bf16_gemm against upcast_linear (float32 path: whether the GEMM takes many rows);
- int4_amx_probe: int4 products on AMX tiles against int4_gemv, by row count (from how many rows int4 layers use
  the tiles, where the CPU has them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.cpu_info import cpu_name_and_flags, isa_summary
from nanoqwen.ops.cpu.matmul import UPCAST_MIN_ROWS, upcast_linear

# rows, in, out: a prompt chunk through a Qwen3-0.6B-sized projection
PROBE_SHAPE = (256, 1024, 1024)
# out, in, copies: a Qwen3-0.6B qkv_proj, 8 copies (64 MiB) so that they come from memory
GEMV_PROBE_SHAPE = (4096, 1024, 8)
GEMV_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
# out, in, copies: a Qwen3-0.6B qkv_proj in int4 (2 MiB, group 64), 32 copies so that they come from memory
AMX_PROBE_SHAPE = (4096, 1024, 32)
AMX_PROBE_ROWS = (2, 4, 8, 16, 32, 64)

def cached(cache_dir: Path | None, what: str, measure: Callable[[], dict]) -> dict:
    """measure()'s result, cached per CPU model, CPU flags, torch version and thread count in
    cpu-matmul.json (measured now where the cache has none)."""
    name, flags = cpu_name_and_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    key = f"{name} | {isa_summary(flags)} | {capability} | torch {torch.__version__}" \
          f" | {torch.get_num_threads()} threads"
    key += "" if what == "matmul" else f" | {what}"
    cache = (cache_dir or _cache_dir()) / "cpu-matmul.json"
    known = _read_json(cache)
    if key in known:
        return known[key]
    known[key] = measure()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    except OSError:  # a read-only home: measure again next time
        pass
    return known[key]


def matmul_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of F.linear on PROBE_SHAPE in `dtype`, best of three runs after a warm-up."""
    rows, n_in, n_out = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(rows, n_in, generator=g).to(dtype),
            torch.randn(n_out, n_in, generator=g).to(dtype))
    best, = _best_seconds([lambda: F.linear(x, w)], rounds=3)
    return 2 * rows * n_in * n_out / best / 1e9


def gemm_probe() -> dict[str, float]:
    """GFLOP/s of nanoqwen's bf16_gemm ("own") and of upcast_linear ("upcast") on bf16 operands of
    PROBE_SHAPE: the best of seven rounds, the two alternating so that both see the same machine."""
    rows, n_in, n_out = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    w = torch.randn(n_out, n_in, generator=g).bfloat16()
    own, upcast = _best_seconds([lambda: cpu_kernels.bf16_gemm(x, w), lambda: upcast_linear(x, w)], rounds=7)
    return {name: round(2 * rows * n_in * n_out / t / 1e9, 1) for name, t in (("own", own), ("upcast", upcast))}


def _best_seconds(calls: list[Callable[[], object]], rounds: int) -> list[float]:
    """Each call's best time in seconds over `rounds` rounds after one warm-up call each (oneDNN picks its kernel
    then), the calls alternating within a round so that all see the same machine."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def gemv_probe(path: str = "bf16", gemm: bool = False) -> dict[int, tuple[float, float]]:
    """For each row count of GEMV_PROBE_ROWS, GB/s of weights read by nanoqwen's bf16_gemv and by what
    those rows take without it on this path (probe_alternative), over copies of a GEMV_PROBE_SHAPE
    matrix that together exceed the L3 cache (as a decode step reads its weights from memory); best of
    five rounds, the two alternating."""
    n, k, copies = GEMV_PROBE_SHAPE
    weights = [torch.ones(n, k, dtype=torch.bfloat16) for _ in range(copies)]  # written: real pages

    def over_copies(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor
                    ) -> Callable[[], None]:
        return lambda: [fn(x, w) for w in weights]

    speeds = {}
    for rows in GEMV_PROBE_ROWS:
        x = torch.ones(rows, k, dtype=torch.bfloat16)
        calls = [over_copies(cpu_kernels.bf16_gemv, x), over_copies(probe_alternative(path, rows, gemm), x)]
        own, theirs = (round(copies * n * k * 2 / t / 1e9, 1) for t in _best_seconds(calls, rounds=5))
        speeds[rows] = (own, theirs)
    return speeds


def int4_amx_probe() -> dict[int, tuple[float, float]]:
    """For each row count of AMX_PROBE_ROWS, GB/s of int4 weights read by cpu_kernels.int4_amx and by int4_gemv
    (without the tiles), over copies of an AMX_PROBE_SHAPE matrix that together exceed the L3 cache; best of five
    rounds, the two alternating."""
    n, k, copies = AMX_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                torch.rand(n, k // 64, generator=g).bfloat16(), torch.rand(n, k // 64, generator=g).bfloat16())
               for _ in range(copies)]
    return _tiles_against(cpu_kernels.int4_amx, cpu_kernels.int4_gemv, weights, k, g)


def bf16_amx_probe() -> dict[int, tuple[float, float]]:
    """As int4_amx_probe, for bf16 weights: cpu_kernels.bf16_amx against torch's F.linear (half as many copies,
    the same bytes)."""
    n, k, copies = AMX_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    weights = [((torch.randn(n, k, generator=g) / k**0.5).bfloat16(),) for _ in range(copies // 2)]
    return _tiles_against(cpu_kernels.bf16_amx, F.linear, weights, k, g)


def int8_amx_probe() -> dict[int, tuple[float, float]]:
    """As int4_amx_probe, for int8 weights with a bf16 scale per row: cpu_kernels.int8_amx against int8_gemv (the
    kernel int8 rows take without the tiles; half as many copies as int4's, the same bytes)."""
    n, k, copies = AMX_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g).bfloat16())
               for _ in range(max(1, copies // 2))]
    return _tiles_against(cpu_kernels.int8_amx, cpu_kernels.int8_gemv, weights, k, g)


def _tiles_against(tiles: Callable, theirs: Callable, weights: list[tuple[torch.Tensor, ...]], k: int,
                   g: torch.Generator) -> dict[int, tuple[float, float]]:
    """{rows: (GB/s of `tiles`, GB/s of `theirs`)} for each row count of AMX_PROBE_ROWS: each kernel(x, *w) over
    every weight in turn, best of five rounds, the two alternating."""
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w)
    speeds = {}
    for rows in AMX_PROBE_ROWS:
        x = torch.randn(rows, k, generator=g).bfloat16()
        calls = [lambda kernel=kernel, x=x: [kernel(x, *w) for w in weights] for kernel in (tiles, theirs)]
        amx, other = (round(nbytes / t / 1e9, 1) for t in _best_seconds(calls, rounds=5))
        speeds[rows] = (amx, other)
    return speeds


def probe_alternative(path: str, rows: int, gemm: bool = False
                      ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What `MatmulPath.linear` runs for this many bf16 rows on this path (with bf16_gemm or not) without the gemv
    kernels."""
    if path != "float32" or rows < UPCAST_MIN_ROWS:
        return F.linear
    return cpu_kernels.bf16_gemm if gemm else upcast_linear


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoqwen"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
